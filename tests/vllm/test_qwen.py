"""Qwen2-VL and Qwen2.5-VL (M-RoPE) served by vLLM with the plug-in, against priortr.apply + HF
generate(): several images per prompt, per-request budgets, and (Qwen2-VL) preemption by recompute
under a tiny KV cache."""

from __future__ import annotations

from itertools import pairwise

import pytest
from vllm import LLM, SamplingParams

from tests.vllm.reference import ENGINE, QWEN_IMAGE, hf_tokens, image, vllm_request

SETTINGS = {"method": "fastv", "budget": 6, "layer": 1}
REQUEST_BUDGETS = [10, 5, 0.25]
"""The budgets this module's requests ask for, which the engine grants (its ``request_budgets``)."""
TOKENS = 12
ONE = f"USER: {QWEN_IMAGE} what is in the image ASSISTANT:"
TWO = f"USER: {QWEN_IMAGE} a {QWEN_IMAGE} what is in the image ASSISTANT:"


@pytest.fixture(scope="module", params=["qwen_dir", "qwen2_5_dir"], ids=["qwen2-vl", "qwen2.5-vl"])
def served(request):
    """(checkpoint, engine) of Qwen2-VL, then of Qwen2.5-VL (its windowed vision tower is vLLM's own)."""
    path = request.getfixturevalue(request.param)
    engine = LLM(
        model=str(path),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        limit_mm_per_prompt={"image": 2, "video": 0},
        **ENGINE,
    )
    yield path, engine
    del engine


def test_one_and_two_images_with_per_request_budgets(served):
    path, llm = served
    cases = [
        (ONE, [image(112, 0)], None),
        (TWO, [image(112, 1), image(56, 2)], None),  # 16 + 4 tokens: the budget splits 5 + 1
        (TWO, [image(112, 3), image(112, 4)], {"budget": 10}),
        (ONE, [image(112, 5)], {"enabled": False}),
    ]
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([vllm_request(*case) for case in cases], params, use_tqdm=False)
    for (prompt, images, budget), out in zip(cases, outs, strict=True):
        settings = None if budget == {"enabled": False} else {**SETTINGS, **(budget or {})}
        assert list(out.outputs[0].token_ids) == hf_tokens(path, prompt, images, settings, TOKENS)
    assert [len(out.prompt_token_ids) for out in outs] == [9 + 6, 12 + 6, 12 + 10, 9 + 16]
    assert hf_tokens(path, *cases[1][:2], None, TOKENS) != list(outs[1].outputs[0].token_ids)


def test_one_image_kept_at_several_counts_in_flight(served):
    """vLLM's encoder cache is keyed by the image, K by the request: one image reaches the engine at
    K = 6, at 3 and 2 twice in one request (budget 5 splits 16 + 16 unevenly), at 10, at 4 (a ratio
    budget, 0.25), at 5 beside another image, unpruned, and beside a text-only prompt, all in one step.
    Every answer must be priortr.apply's (on main the later requests of an image came back empty)."""
    path, llm = served
    picture = image(112, 60)
    cases = [
        (ONE, [picture], None),
        (TWO, [picture, picture], {"budget": 5}),
        (ONE, [picture], {"budget": 10}),
        (ONE, [picture], {"budget": 0.25}),
        (ONE, [picture], {"enabled": False}),
        (TWO, [picture, image(56, 61)], None),
        ("USER: what is the color of the cat ASSISTANT:", [], None),
    ]
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([vllm_request(*case) for case in cases], params, use_tqdm=False)
    for index, ((prompt, images, budget), out) in enumerate(zip(cases, outs, strict=True)):
        pruned = images and budget != {"enabled": False}
        settings = {**SETTINGS, **(budget or {})} if pruned else None
        assert list(out.outputs[0].token_ids) == hf_tokens(path, prompt, images, settings, TOKENS), index
    assert [len(out.prompt_token_ids) for out in outs] == [9 + 6, 12 + 5, 9 + 10, 9 + 4, 9 + 16, 12 + 6, 9]


@pytest.mark.parametrize("step", [96, 20], ids=["whole", "chunked"])
def test_preemption_by_recompute_is_exact(qwen_dir, step, monkeypatch):
    """A KV cache of 4 blocks of 32 tokens (3 usable) cannot hold four 18-token prompts decoding 40
    tokens each: vLLM preempts and later re-prefills prompt + generated tokens, in one step, or, with
    steps of 20 tokens, the prompt and the first generated tokens in one step and the rest in the
    next; the scores must use the prompt's rows only, as they did the first time. Prefix caching is
    on: the re-prefill must not hit the request's own blocks either. Two 56 x 56 images (4 tokens each)
    make a prompt of 20 tokens whole, so that it fits a step of 20 (the processor refuses a longer one)
    while a re-prefill of it with its generated tokens does not."""
    engine = LLM(
        model=str(qwen_dir),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        limit_mm_per_prompt={"image": 2, "video": 0},
        num_gpu_blocks_override=4,
        disable_log_stats=False,
        block_size=32,
        **{**ENGINE, "max_model_len": 96, "max_num_batched_tokens": step},
    )
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    scheduled: dict[str, list[int]] = {}
    schedule = scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for name, count in out.num_scheduled_tokens.items():
            scheduled.setdefault(name, []).append(count)
        return out

    monkeypatch.setattr(scheduler, "schedule", recording)
    cases = [(TWO, [image(56, 20 + i), image(56, 30 + i)]) for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs = engine.generate([vllm_request(*case) for case in cases], params, use_tqdm=False)
    stats = engine.llm_engine.get_metrics()
    for (prompt, images), out in zip(cases, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_tokens(qwen_dir, prompt, images, SETTINGS, 40)
    preempted = [metric for metric in stats if metric.name == "vllm:num_preemptions"]
    assert preempted and preempted[0].value > 0, "the cache was large enough: nothing was preempted"
    cut = [name for name, runs in scheduled.items() if any(a == step and b > 1 for a, b in pairwise(runs))]
    assert bool(cut) == (step == 20)  # a re-prefill cut after its prompt, only where a step is short
    del engine


def test_adjacent_images_are_refused_with_the_reason(served):
    """Qwen's chat template wraps every image in ``<|vision_start|>`` ... ``<|vision_end|>``; two
    ``<|image_pad|>`` in one pair (a raw prompt) are one run for priortr.apply, whose M-RoPE positions
    the plug-in has not checked: refused in the front end, with the reason and the fix."""
    _, llm = served
    adjacent = (
        "USER: <|vision_start|><|image_pad|><|image_pad|><|vision_end|> what is in the image ASSISTANT:"
    )
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"never writes two images back to back.*put text between images"):
        llm.generate([vllm_request(adjacent, [image(56, 7), image(56, 8)])], params, use_tqdm=False)
