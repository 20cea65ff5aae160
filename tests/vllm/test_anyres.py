"""LLaVA-OneVision and LLaVA-NeXT (AnyRes crops, a newline feature after every grid row; the plug-in
serves both with one mixin, ``models.AnyResImages``) served by vLLM with the plug-in, against
priortr.apply + HF generate(): every test runs on each family's tiny checkpoint.

The tiny checkpoints' crops are 28 px and 16 tokens: a 28x28 image is 36 tokens (base crop 16, one
4x4 crop and 4 newlines), 56x28 is 52 (a 4x8 grid), 56x56 is 88 (8x8 and 8 newlines). The newline
rows are visual tokens of the image's run, pruned like the others. Two images with no text between
them (LLaVA-OneVision's chat template) are one run under one budget, as ``priortr.apply`` prunes them.
Negative controls patch a fault into the plug-in (decode one position off, the kept tokens'
keys/values not written, a run's budget split per image) and the answer must then differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm import LLM, SamplingParams

from priortr.integrations.vllm import models, processor
from priortr.integrations.vllm.registration import UNSERVED
from tests.vllm.harness import (
    ANSWER_TOKENS,
    apply_settings,
    generate,
    run_arrivals,
    shift_decode_offset,
    skip_kv_rewrite,
    split_run_budget,
)
from tests.vllm.reference import ENGINE, hf_tokens, image, vllm_request

SETTINGS = {"method": "priortr", "budget": 8, "layer": 1}
REQUEST_BUDGETS = [12, 4]
"""The budgets this module's requests ask for, which the engine grants (its ``request_budgets``)."""
TOKENS = ANSWER_TOKENS
ONE = "USER: <image> what is in the image ASSISTANT:"  # 7 text tokens
TWO = "USER: <image> a <image> what is in the image ASSISTANT:"  # 8
TEXT_ONLY = "USER: what is the color of the cat ASSISTANT:"


FAMILIES = {
    "llava-onevision": (
        "onevision_dir",
        models.PruningLlavaOnevision,
        "LlavaOnevisionForConditionalGeneration",
    ),
    "llava-next": ("llava_next_dir", models.PruningLlavaNext, "LlavaNextForConditionalGeneration"),
}
"""Each family's checkpoint fixture, plug-in class and vLLM architecture."""


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def path(family: str, request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(FAMILIES[family][0])


def limits(family: str, images: int) -> dict[str, int]:
    """Images per prompt; OneVision serves videos too, which these prompts have none of."""
    return {"image": images, "video": 0} if family == "llava-onevision" else {"image": images}


@pytest.fixture(scope="module")
def llm(family, path):
    engine = LLM(
        model=str(path),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        limit_mm_per_prompt=limits(family, 2),
        **ENGINE,
    )
    yield engine
    del engine


CASES = [
    (ONE, [image(56, 0, height=28)], None),
    (ONE, [image(56, 1)], {"budget": 12}),
    (TWO, [image(56, 2, height=28), image(28, 6)], None),  # 52 + 36 tokens share the budget of 8
    (ONE, [image(56, 3, height=28)], {"enabled": False}),  # an unpruned image in a pruned step
    (TEXT_ONLY, [], None),
]


def test_one_step_of_images_text_budgets_and_pruning_off(llm, family, path):
    _, cls, architecture = FAMILIES[family]
    assert llm.apply_model(type) == [cls]
    assert architecture not in UNSERVED
    outs = generate(llm, CASES)
    for index, ((prompt, images, budget), out) in enumerate(zip(CASES, outs, strict=True)):
        expected = hf_tokens(path, prompt, images, apply_settings(SETTINGS, images, budget), TOKENS)
        assert list(out.outputs[0].token_ids) == expected, index
    assert [len(out.prompt_token_ids) for out in outs] == [7 + 8, 7 + 12, 8 + 8, 7 + 52, 9]
    for case, out in zip(CASES[:3], outs[:3], strict=True):  # pruning changed the answers
        assert hf_tokens(path, *case[:2], None, TOKENS) != list(out.outputs[0].token_ids)


def test_requests_arriving_while_others_decode(llm, path):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    cases = [
        (ONE, [image(56, 10)], None),
        (ONE, [image(28, 11)], {"budget": 4}),
        (ONE, [image(56, 12, height=28)], {"enabled": False}),
        (TEXT_ONLY, [], None),
    ]
    arrivals = {0: [0], 2: [1, 2], 5: [3]}  # engine step -> requests added before it
    requests = {index: vllm_request(*cases[index]) for index in range(len(cases))}
    results = run_arrivals(engine, requests, arrivals, params)
    for index, (prompt, images, budget) in enumerate(cases):
        expected = hf_tokens(path, prompt, images, apply_settings(SETTINGS, images, budget), TOKENS)
        assert results[index] == expected, index


def test_wrong_decode_offset_is_caught(llm, path, monkeypatch):
    """Negative control: decoding one position off the original positions changes the answer."""
    shift_decode_offset(monkeypatch)
    case = CASES[0]
    out = generate(llm, [case])[0]
    assert list(out.outputs[0].token_ids) != hf_tokens(path, *case[:2], SETTINGS, TOKENS)


def test_skipped_kv_rewrite_is_caught(llm, path, monkeypatch):
    """Negative control: leaving layers 0..L's cache without the kept tokens' keys/values changes the
    answer."""
    skip_kv_rewrite(monkeypatch)
    case = CASES[1]
    out = generate(llm, [case])[0]
    assert list(out.outputs[0].token_ids) != hf_tokens(path, *case[:2], {**SETTINGS, **case[2]}, TOKENS)


ADJACENT = "USER: <image><image> what is in the image ASSISTANT:"  # 7 text tokens
"""Two images back to back, as LLaVA-OneVision's llava-hf chat template writes a message's images."""
ADJACENT_CASES = [
    (ADJACENT, [image(56, 30, height=28), image(28, 31)], None),  # 52 + 36 tokens, one run keeps 8
    (ADJACENT, [image(28, 32), image(56, 33)], {"budget": 40}),  # 36 + 88: the first image's slots all kept
]


def test_adjacent_images_are_one_run_under_one_budget(llm, path):
    """Images with no text between them are one run of placeholders, which priortr.apply prunes as one
    item (one budget, one separator after the run); the plug-in keeps the run's K in the images' slots
    (``processor.split_run``), in a step with a request whose images have text between them."""
    cases = [*ADJACENT_CASES, CASES[2]]
    outs = generate(llm, cases)
    for index, ((prompt, images, budget), out) in enumerate(zip(cases, outs, strict=True)):
        expected = hf_tokens(path, prompt, images, apply_settings(SETTINGS, images, budget), TOKENS)
        assert list(out.outputs[0].token_ids) == expected, index
    assert [len(out.prompt_token_ids) for out in outs] == [7 + 8, 7 + 40, 8 + 8]
    for case, out in zip(ADJACENT_CASES, outs[:2], strict=True):  # pruning changed the answers
        assert hf_tokens(path, *case[:2], None, TOKENS) != list(out.outputs[0].token_ids)


def test_adjacent_images_answer_alike_whichever_image_holds_the_slots(llm, path, monkeypatch):
    """The run's kept tokens fill its images' slots in prompt order, whichever image vLLM counts them
    under: the last image taking the slots first gives apply's answer too."""
    original = processor.split_run
    monkeypatch.setattr(processor, "split_run", lambda kept, tokens: original(kept, tokens[::-1])[::-1])
    case = ADJACENT_CASES[0]
    out = generate(llm, [case])[0]
    assert list(out.outputs[0].token_ids) == hf_tokens(path, *case[:2], SETTINGS, TOKENS)


def test_budget_split_per_image_is_caught(llm, path, monkeypatch):
    """Negative control: the run's budget of 8 split over its images in proportion to their tokens
    (52 : 36, so 5 + 3), each image keeping its own top tokens by the run's scores, changes the
    answer."""
    split_run_budget(monkeypatch, sizes=(52, 36), shares=(5, 3))
    case = ADJACENT_CASES[0]
    out = generate(llm, [case])[0]
    assert list(out.outputs[0].token_ids) != hf_tokens(path, *case[:2], SETTINGS, TOKENS)


def test_split_run_fills_the_images_in_order():
    """Hand-computed splits: each image 1 to N slots, the first images filled first, the sum the run's K."""
    assert processor.split_run(8, [52, 36]) == [7, 1]
    assert processor.split_run(40, [36, 88]) == [36, 4]
    assert processor.split_run(5, [2, 2, 3]) == [2, 2, 1]
    assert processor.split_run(3, [2, 2, 3]) == [1, 1, 1]
    assert processor.split_run(6, [16]) == [6]
    with pytest.raises(ValueError, match="keeps 1 tokens of a run of 2 images"):
        processor.split_run(1, [16, 16])


def test_run_keeping_fewer_tokens_than_its_images_is_refused(llm):
    """vLLM places an image on at least one token: a run of two images keeping one is refused."""
    with pytest.raises(ValueError, match="ask for a larger budget, or put text between images"):
        generate(llm, [(ADJACENT, [image(28, 7), image(28, 8)], {"budget": 1})])


def test_preemption_by_recompute_is_exact(family, path):
    """A KV cache of 4 blocks of 32 tokens (3 usable) cannot hold four 15-token prompts decoding 40
    tokens each: vLLM preempts and re-prefills prompt + generated tokens in one step. Last in the
    module: deleting its engine tears down vLLM's process groups, which the module's engine needs."""
    engine = LLM(
        model=str(path),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        limit_mm_per_prompt=limits(family, 1),
        num_gpu_blocks_override=4,
        disable_log_stats=False,
        block_size=32,
        **{**ENGINE, "max_model_len": 96, "max_num_batched_tokens": 96},
    )
    cases = [(ONE, [image(56, 20 + i, height=28)]) for i in range(4)]
    outs = generate(engine, cases, tokens=40)
    stats = engine.llm_engine.get_metrics()
    for (prompt, images), out in zip(cases, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_tokens(path, prompt, images, SETTINGS, 40)
    preempted = [metric for metric in stats if metric.name == "vllm:num_preemptions"]
    assert preempted and preempted[0].value > 0, "the cache was large enough: nothing was preempted"
    del engine
