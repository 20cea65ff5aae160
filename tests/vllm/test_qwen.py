"""Qwen2-VL and Qwen2.5-VL (M-RoPE) served by vLLM with the plug-in: the family contract
(``family_contract.py``) and Qwen's own checks, on one engine per family, against priortr.apply + HF
generate(); and (Qwen2-VL) preemption by recompute in steps shorter than a re-prefill."""

from __future__ import annotations

import pytest

from tests.vllm.family_contract import (
    FAMILIES,
    PREEMPTED_TOKENS,
    QWEN_ONE,
    QWEN_TWO,
    FamilyContract,
    answers,
    cut_after_a_full_step,
    expected,
    preemption_engine,
    record_schedule,
)
from tests.vllm.harness import generate
from tests.vllm.reference import image


class QwenChecks(FamilyContract):
    """Qwen2-VL's and Qwen2.5-VL's own checks (its windowed vision tower is vLLM's own)."""

    def test_one_image_kept_at_several_counts_in_flight(self, llm, row, path):
        """vLLM's encoder cache is keyed by the image, K by the request: one image reaches the engine at
        K = 6, at 3 and 2 twice in one request (budget 5 splits 16 + 16 unevenly), at 10, at 4 (a
        ratio budget, 0.25), at 5 beside another image, unpruned, and beside a text-only prompt, all in
        one step. Every answer must be priortr.apply's (on main the later requests of an image came
        back empty)."""
        picture = image(112, 60)
        cases = [
            (QWEN_ONE, [picture], None),
            (QWEN_TWO, [picture, picture], {"budget": 5}),
            (QWEN_ONE, [picture], {"budget": 10}),
            (QWEN_ONE, [picture], {"budget": 0.25}),
            (QWEN_ONE, [picture], {"enabled": False}),
            (QWEN_TWO, [picture, image(56, 61)], None),
            ("USER: what is the color of the cat ASSISTANT:", [], None),
        ]
        outs = generate(llm, cases)
        for index, (case, answer) in enumerate(zip(cases, answers(outs), strict=True)):
            assert answer == expected(row, path, case), index
        lengths = [len(out.prompt_token_ids) for out in outs]
        assert lengths == [9 + 6, 12 + 5, 9 + 10, 9 + 4, 9 + 16, 12 + 6, 9]

    def test_adjacent_images_are_refused_with_the_reason(self, llm):
        """Qwen's chat template wraps every image in ``<|vision_start|>`` ... ``<|vision_end|>``; two
        ``<|image_pad|>`` in one pair (a raw prompt) are one run for priortr.apply, whose M-RoPE
        positions the plug-in has not checked: refused in the front end, with the reason and the fix."""
        adjacent = (
            "USER: <|vision_start|><|image_pad|><|image_pad|><|vision_end|> what is in the image ASSISTANT:"
        )
        with pytest.raises(
            ValueError, match=r"never writes two images back to back.*put text between images"
        ):
            generate(llm, [(adjacent, [image(56, 7), image(56, 8)], None)])


class TestQwen2VL(QwenChecks):
    family = "qwen2-vl"


class TestQwen2_5_VL(QwenChecks):
    family = "qwen2.5-vl"


def test_preemption_in_short_steps_is_exact(qwen_dir, monkeypatch):
    """The contract's preemption in steps of 20 tokens: vLLM re-prefills the prompt and the first
    generated tokens in one step and the rest in the next; the scores must use the prompt's rows only,
    as they did the first time. Prefix caching is on: the re-prefill must not hit the request's own
    blocks either. Two 56 x 56 images (4 tokens each) make a prompt of 20 tokens whole, so that it fits
    a step of 20 (the processor refuses a longer one) while a re-prefill of it with its generated tokens
    does not."""
    row = FAMILIES["qwen2-vl"]
    engine = preemption_engine(row, qwen_dir, step_tokens=20)
    scheduled = record_schedule(engine, monkeypatch)
    cases = [(QWEN_TWO, [image(56, 20 + i), image(56, 30 + i)], None) for i in range(4)]
    outs = generate(engine, cases, tokens=PREEMPTED_TOKENS)
    stats = engine.llm_engine.get_metrics()
    for case, answer in zip(cases, answers(outs), strict=True):
        assert answer == expected(row, qwen_dir, case, PREEMPTED_TOKENS)
    preempted = [metric for metric in stats if metric.name == "vllm:num_preemptions"]
    assert preempted and preempted[0].value > 0, "the cache was large enough: nothing was preempted"
    assert cut_after_a_full_step(scheduled, 20)  # a re-prefill cut after its prompt
    del engine
