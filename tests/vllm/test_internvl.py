"""InternVL in the Hugging Face format (``InternVLForConditionalGeneration``: ``<img>`` / ``</img>`` around
each image's ``<IMG_CONTEXT>`` run, its crops and thumbnail in one run) served by vLLM with the plug-in,
against priortr.apply + HF generate().

vLLM's placeholder range of an image spans ``<img> ... </img>`` with an ``is_embed`` mask on the
``<IMG_CONTEXT>`` tokens; the two markers stay text. The tiny checkpoint's tiles are 56 px and 16 tokens:
a 56x56 image is one tile (16 tokens), 112x56 two crops and a thumbnail (48), 112x112 four crops and a
thumbnail (80). One engine serves the module; negative controls patch a fault into the plug-in (decode
one position off, the kept tokens' keys/values not written) and the answer must then differ.
"""

from __future__ import annotations

import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.multimodal.inputs import PlaceholderRange

from priortr.integrations.vllm import models
from priortr.integrations.vllm.request_layout import embedded_tokens, shrink_prompt
from tests.vllm.harness import (
    ANSWER_TOKENS,
    apply_settings,
    generate,
    run_arrivals,
    shift_decode_offset,
    skip_kv_rewrite,
)
from tests.vllm.reference import ENGINE, hf_tokens, image, vllm_request

SETTINGS = {"method": "priortr", "budget": 8, "layer": 1}
REQUEST_BUDGETS = [12, 4, 2]
"""The budgets this module's requests ask for, which the engine grants (its ``request_budgets``)."""
TOKENS = ANSWER_TOKENS
IMAGE = "<IMG_CONTEXT>"
ONE = f"USER: {IMAGE} what is in the image ASSISTANT:"  # 9 text tokens with <img> and </img>
TWO = f"USER: {IMAGE} a {IMAGE} what is in the image ASSISTANT:"  # 12
TEXT_ONLY = "USER: what is the color of the cat ASSISTANT:"


def wide(seed: int) -> object:
    """112x56: two crops and the thumbnail, 48 tokens."""
    return image(112, seed, height=56)


def tile(seed: int) -> object:
    """56x56: one tile, 16 tokens."""
    return image(56, seed)


def square(seed: int) -> object:
    """112x112: four crops and the thumbnail, 80 tokens."""
    return image(112, seed)


@pytest.fixture(scope="module")
def llm(internvl_dir):
    engine = LLM(
        model=str(internvl_dir),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        limit_mm_per_prompt={"image": 2, "video": 0},
        **ENGINE,
    )
    yield engine
    del engine


CASES = [
    (ONE, [wide(0)], None),
    (TWO, [square(1), tile(2)], None),  # 80 + 16 tokens share the budget of 8
    (TWO, [wide(3), tile(4)], {"budget": 12}),
    (ONE, [wide(5)], {"enabled": False}),  # an unpruned image in a pruned step
    (TEXT_ONLY, [], None),
]


def test_one_step_of_images_text_budgets_and_pruning_off(llm, internvl_dir):
    assert llm.apply_model(type) == [models.PruningInternVL]
    outs = generate(llm, CASES)
    for index, ((prompt, images, budget), out) in enumerate(zip(CASES, outs, strict=True)):
        expected = hf_tokens(internvl_dir, prompt, images, apply_settings(SETTINGS, images, budget), TOKENS)
        assert list(out.outputs[0].token_ids) == expected, index
    assert [len(out.prompt_token_ids) for out in outs] == [9 + 8, 12 + 8, 12 + 12, 9 + 48, 9]
    kept = outs[0].prompt_token_ids
    assert kept[1] == 198 and kept[2:10] == [199] * 8 and kept[10] == 197  # <img> K x <IMG_CONTEXT> </img>
    for case, out in zip(CASES[:2], outs[:2], strict=True):  # pruning changed the answers
        assert hf_tokens(internvl_dir, *case[:2], None, TOKENS) != list(out.outputs[0].token_ids)


def test_requests_arriving_while_others_decode(llm, internvl_dir):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    cases = [
        (ONE, [square(10)], None),
        (TWO, [tile(11), wide(12)], {"budget": 4}),
        (ONE, [wide(13)], {"enabled": False}),
        (TEXT_ONLY, [], None),
        (ONE, [tile(14)], {"budget": 2}),
    ]
    arrivals = {0: [0], 2: [1, 2], 5: [3, 4]}  # engine step -> requests added before it
    requests = {index: vllm_request(*cases[index]) for index in range(len(cases))}
    results = run_arrivals(engine, requests, arrivals, params)
    for index, (prompt, images, budget) in enumerate(cases):
        expected = hf_tokens(internvl_dir, prompt, images, apply_settings(SETTINGS, images, budget), TOKENS)
        assert results[index] == expected, index


def test_wrong_decode_offset_is_caught(llm, internvl_dir, monkeypatch):
    """Negative control: decoding one position off the original positions changes the answer."""
    shift_decode_offset(monkeypatch)
    case = CASES[0]
    out = generate(llm, [case])[0]
    assert list(out.outputs[0].token_ids) != hf_tokens(internvl_dir, *case[:2], SETTINGS, TOKENS)


def test_skipped_kv_rewrite_is_caught(llm, internvl_dir, monkeypatch):
    """Negative control: leaving layers 0..L's cache without the kept tokens' keys/values changes the
    answer."""
    skip_kv_rewrite(monkeypatch)
    case = CASES[1]
    out = generate(llm, [case])[0]
    assert list(out.outputs[0].token_ids) != hf_tokens(internvl_dir, *case[:2], SETTINGS, TOKENS)


def test_preemption_by_recompute_is_exact(internvl_dir):
    """A KV cache of 4 blocks of 32 tokens (3 usable) cannot hold four 20-token prompts decoding 40
    tokens each: vLLM preempts and re-prefills prompt + generated tokens in one step."""
    engine = LLM(
        model=str(internvl_dir),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        limit_mm_per_prompt={"image": 2, "video": 0},
        num_gpu_blocks_override=4,
        disable_log_stats=False,
        block_size=32,
        **{**ENGINE, "max_model_len": 96, "max_num_batched_tokens": 96},
    )
    cases = [(TWO, [wide(20 + i), tile(30 + i)]) for i in range(4)]
    outs = generate(engine, cases, tokens=40)
    stats = engine.llm_engine.get_metrics()
    for (prompt, images), out in zip(cases, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_tokens(internvl_dir, prompt, images, SETTINGS, 40)
    preempted = [metric for metric in stats if metric.name == "vllm:num_preemptions"]
    assert preempted and preempted[0].value > 0, "the cache was large enough: nothing was preempted"
    del engine


def test_internvl3_5_qwen3_text_model(internvl3_5_dir):
    """InternVL3.5's language model is Qwen3 (q/k norms before RoPE in the scored attention): pruned
    one- and two-image prompts beside an unpruned image and a text-only prompt equal apply + HF."""
    engine = LLM(
        model=str(internvl3_5_dir),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        limit_mm_per_prompt={"image": 2, "video": 0},
        **ENGINE,
    )
    assert engine.apply_model(type) == [models.PruningInternVL]
    cases = [CASES[0], CASES[2], CASES[3], CASES[4]]
    outs = generate(engine, cases)
    for index, ((prompt, images, budget), out) in enumerate(zip(cases, outs, strict=True)):
        expected = hf_tokens(
            internvl3_5_dir, prompt, images, apply_settings(SETTINGS, images, budget), TOKENS
        )
        assert list(out.outputs[0].token_ids) == expected, index
    assert hf_tokens(internvl3_5_dir, *cases[0][:2], None, TOKENS) != list(outs[0].outputs[0].token_ids)
    del engine


def mask(flags: str) -> torch.Tensor:
    return torch.tensor([flag == "e" for flag in flags])


def test_shrink_keeps_the_text_inside_a_range():
    """Hand-computed: two InternVL images ``<img> c c c c </img>`` (4 embedded) and ``<img> c c </img>``
    (2) keep 1 and 2; the markers stay, each range shrinks by the embedded tokens it drops, and its
    is_embed mask is cut alike."""
    prompt = [5, 198, 199, 199, 199, 199, 197, 6, 198, 199, 199, 197, 7]
    ranges = [
        PlaceholderRange(offset=8, length=4, is_embed=mask("teet")),
        PlaceholderRange(offset=1, length=6, is_embed=mask("teeeet")),
    ]
    assert [embedded_tokens(span) for span in ranges] == [(9, 2), (2, 4)]
    short, new = shrink_prompt(prompt, ranges, [2, 1])
    assert short == [5, 198, 199, 197, 6, 198, 199, 199, 197, 7]
    assert [(span.offset, span.length, span.is_embed.tolist()) for span in new] == [
        (5, 4, [False, True, True, False]),
        (1, 3, [False, True, False]),
    ]
    plain, _ = shrink_prompt([5, 199, 199, 199, 6], [PlaceholderRange(offset=1, length=3)], [2])
    assert plain == [5, 199, 199, 6]
