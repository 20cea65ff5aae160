"""Mistral 3 (``Mistral3ForConditionalGeneration``: a Pixtral tower at the image's own aspect ratio) served
by vLLM with the plug-in, against priortr.apply + HF generate().

vLLM lays out an image of ``rows x cols`` tokens as ``PixtralProcessor`` writes it: ``[IMG] x cols
[IMG_BREAK]`` per row, the last break replaced by ``[IMG_END]``, one placeholder range whose ``is_embed``
mask marks the ``[IMG]`` tokens. ``priortr.apply`` keeps K of the ``[IMG]`` tokens and every row break;
a pruned prompt holds K ``[IMG]`` slots, then the row breaks and ``[IMG_END]``. The tiny checkpoint's
tokens are 16 x 16 px: a 32 x 48 image is 2 x 3 tokens, 64 x 32 is 4 x 2, 48 x 64 is 3 x 4, 64 x 64 is
4 x 4. One engine serves the module; negative controls patch a fault into the plug-in (decode one
position off, the kept tokens' keys/values not written) and the answer must then differ.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.multimodal.inputs import PlaceholderRange

from priortr.integrations.vllm import models
from priortr.integrations.vllm.decoder import check_options
from priortr.integrations.vllm.positions import (
    LINEAR_ROPE_ROW_BREAKS,
    ImageSlots,
    linear_positions,
    request_positions,
)
from priortr.integrations.vllm.registration import UNSERVED
from priortr.integrations.vllm.request_layout import embedded_tokens, shrink_prompt
from tests.helpers.tiny_mistral3 import MISTRAL3_BREAK_ID, MISTRAL3_END_ID, MISTRAL3_IMAGE_ID
from tests.vllm import checkpoints
from tests.vllm.checkpoints import MISTRAL3_TOKEN_PIXELS
from tests.vllm.harness import (
    ANSWER_TOKENS,
    apply_settings,
    generate,
    run_arrivals,
    shift_decode_offset,
    skip_kv_rewrite,
)
from tests.vllm.reference import ENGINE, hf_tokens, image, vllm_request

SETTINGS = {"method": "priortr", "budget": 4, "layer": 1}
REQUEST_BUDGETS = [10, 6, 2]
"""The budgets this module's requests ask for, which the engine grants (its ``request_budgets``)."""
TOKENS = ANSWER_TOKENS
IMG, BREAK, END = MISTRAL3_IMAGE_ID, MISTRAL3_BREAK_ID, MISTRAL3_END_ID
ONE = "USER: [IMG] what is in the image ASSISTANT:"  # 7 text tokens
TWO = "USER: [IMG] a [IMG] what is in the image ASSISTANT:"  # 8
TEXT_ONLY = "USER: what is the color of the cat ASSISTANT:"  # 9


def grid(rows: int, cols: int, seed: int) -> object:
    """A random image of ``rows x cols`` tokens."""
    return image(cols * MISTRAL3_TOKEN_PIXELS, seed, height=rows * MISTRAL3_TOKEN_PIXELS)


@pytest.fixture(scope="module")
def llm(mistral3_dir):
    engine = LLM(
        model=str(mistral3_dir),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        limit_mm_per_prompt={"image": 2},
        **ENGINE,
    )
    yield engine
    del engine


CASES = [
    (ONE, [grid(4, 4, 0)], None),
    (TWO, [grid(2, 3, 1), grid(4, 2, 2)], None),  # 6 + 8 tokens share the budget of 4
    (TWO, [grid(4, 4, 3), grid(3, 4, 4)], {"budget": 10}),
    (ONE, [grid(2, 3, 5)], {"enabled": False}),  # an unpruned image in a pruned step
    (TEXT_ONLY, [], None),
]


def test_one_step_of_images_text_budgets_and_pruning_off(llm, mistral3_dir):
    assert llm.apply_model(type) == [models.PruningMistral3]
    assert "Mistral3ForConditionalGeneration" not in UNSERVED
    outs = generate(llm, CASES)
    for index, ((prompt, images, budget), out) in enumerate(zip(CASES, outs, strict=True)):
        expected = hf_tokens(mistral3_dir, prompt, images, apply_settings(SETTINGS, images, budget), TOKENS)
        assert list(out.outputs[0].token_ids) == expected, index
    # text, K [IMG] slots per image, then each image's row breaks and [IMG_END]
    assert [len(out.prompt_token_ids) for out in outs] == [7 + 4 + 4, 8 + 4 + 2 + 4, 8 + 10 + 4 + 3, 7 + 8, 9]
    assert outs[0].prompt_token_ids[1:9] == [IMG] * 4 + [BREAK] * 3 + [END]
    assert outs[3].prompt_token_ids[1:9] == [IMG] * 3 + [BREAK] + [IMG] * 3 + [END]  # vLLM's own layout
    for case, out in zip(CASES[:3], outs[:3], strict=True):  # pruning changed the answers
        assert hf_tokens(mistral3_dir, *case[:2], None, TOKENS) != list(out.outputs[0].token_ids)


def test_requests_arriving_while_others_decode(llm, mistral3_dir):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    cases = [
        (ONE, [grid(3, 4, 10)], None),
        (TWO, [grid(2, 3, 11), grid(4, 4, 12)], {"budget": 6}),
        (ONE, [grid(4, 2, 13)], {"enabled": False}),
        (TEXT_ONLY, [], None),
        (ONE, [grid(4, 2, 14)], {"budget": 2}),
    ]
    arrivals = {0: [0], 2: [1, 2], 5: [3, 4]}  # engine step -> requests added before it
    requests = {index: vllm_request(*cases[index]) for index in range(len(cases))}
    results = run_arrivals(engine, requests, arrivals, params)
    for index, (prompt, images, budget) in enumerate(cases):
        expected = hf_tokens(mistral3_dir, prompt, images, apply_settings(SETTINGS, images, budget), TOKENS)
        assert results[index] == expected, index


def test_wrong_decode_offset_is_caught(llm, mistral3_dir, monkeypatch):
    """Negative control: decoding one position off the original positions changes the answer."""
    shift_decode_offset(monkeypatch)
    case = CASES[0]
    out = generate(llm, [case])[0]
    assert list(out.outputs[0].token_ids) != hf_tokens(mistral3_dir, *case[:2], SETTINGS, TOKENS)


def test_skipped_kv_rewrite_is_caught(llm, mistral3_dir, monkeypatch):
    """Negative control: leaving layers 0..L's cache without the kept tokens' keys/values changes the
    answer."""
    skip_kv_rewrite(monkeypatch)
    case = CASES[1]
    out = generate(llm, [case])[0]
    assert list(out.outputs[0].token_ids) != hf_tokens(mistral3_dir, *case[:2], SETTINGS, TOKENS)


def test_preemption_by_recompute_is_exact(mistral3_dir):
    """A KV cache of 4 blocks of 32 tokens (3 usable) cannot hold four 18-token prompts decoding 40
    tokens each: vLLM preempts and re-prefills prompt + generated tokens in one step."""
    engine = LLM(
        model=str(mistral3_dir),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        limit_mm_per_prompt={"image": 2},
        num_gpu_blocks_override=4,
        disable_log_stats=False,
        block_size=32,
        **{**ENGINE, "max_model_len": 96, "max_num_batched_tokens": 96},
    )
    cases = [(TWO, [grid(2, 3, 20 + i), grid(4, 2, 30 + i)]) for i in range(4)]
    outs = generate(engine, cases, tokens=40)
    stats = engine.llm_engine.get_metrics()
    for (prompt, images), out in zip(cases, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_tokens(mistral3_dir, prompt, images, SETTINGS, 40)
    preempted = [metric for metric in stats if metric.name == "vllm:num_preemptions"]
    assert preempted and preempted[0].value > 0, "the cache was large enough: nothing was preempted"
    del engine


def mask(flags: str) -> torch.Tensor:
    return torch.tensor([flag == "e" for flag in flags])


def test_shrink_keeps_the_row_breaks():
    """Hand-computed: a 2 x 3 image ``I I I B I I I E`` keeping 4 and a 2 x 2 image ``I I B I I E``
    keeping 1: each range becomes its K [IMG] slots, then its row breaks and [IMG_END], its is_embed
    mask alike."""
    I, B, E = IMG, BREAK, END  # noqa: E741
    prompt = [5, I, I, I, B, I, I, I, E, 6, I, I, B, I, I, E, 7]
    ranges = [
        PlaceholderRange(offset=10, length=6, is_embed=mask("eeteet")),
        PlaceholderRange(offset=1, length=8, is_embed=mask("eeeteeet")),
    ]
    assert [embedded_tokens(span) for span in ranges] == [(10, 4), (1, 6)]
    short, new = shrink_prompt(prompt, ranges, [1, 4])
    assert short == [5, I, I, I, I, B, E, 6, I, B, E, 7]
    assert [(span.offset, span.length, span.is_embed.tolist()) for span in new] == [
        (8, 3, [True, False, False]),
        (1, 6, [True, True, True, True, False, False]),
    ]


def test_positions_put_the_row_breaks_back_between_the_rows():
    """Hand-computed: the pruned prompt ``t I I B E t`` of a 2 x 2 image keeping 2 is the full prompt
    ``t I I B I I E t`` (positions 0..7): the row break keeps position 3, [IMG_END] 6, the last token 7;
    the slots hold the record (prompt length 6, grid 2 x 2) and decoding continues at 8 = 6 + 2."""
    breaks = LINEAR_ROPE_ROW_BREAKS.breaks
    assert breaks((2, 2)) == (2,) and breaks((3, 4)) == (4, 8) and breaks((1, 5)) == ()
    short = [5, IMG, IMG, BREAK, END, 6]
    slots = ImageSlots(offset=1, kept=2, tokens=4, grid=(2, 2), breaks=breaks((2, 2)))
    positions, delta = request_positions(short, [slots], IMG, linear_positions, 6)
    assert positions[0].tolist() == [0, 6, 6, 3, 6, 7]
    assert positions[1, 1:3].tolist() == [2, 2] and positions[2, 1:3].tolist() == [2, 2]
    assert delta == 2


def test_ministral3_query_scaling_is_refused():
    """Ministral 3's text model scales queries by position (Llama 4's scaling, vLLM's MistralAttention
    ``do_llama_4_scaling``), which the plug-in's layer steps do not run: refused when the model loads,
    not served with unscaled queries; a Mistral layer without it (Mistral Small 3.1) loads."""

    def layer(scaling: bool, t_cond: object = None) -> SimpleNamespace:
        attention = SimpleNamespace(do_llama_4_scaling=scaling)
        return SimpleNamespace(self_attn=attention, ada_rms_norm_t_cond=t_cond)

    with pytest.raises(ValueError, match=r"query scaling \(llama_4_scaling"):
        check_options(layer(True))
    with pytest.raises(ValueError, match="ada_rms_norm_t_cond"):
        check_options(layer(False, t_cond=torch.nn.Identity()))
    check_options(layer(False))


def test_a_sliding_window_is_refused_when_the_model_loads(tmp_path):
    """A Mistral text model with a sliding window (Mistral 7B's 4096 tokens; here 32) is refused with
    priortr settings when the model loads, not served with whole-prompt attention in layers 0..L and a
    window counted over cache slots after them; the same checkpoint without them is vLLM's own model."""
    path = checkpoints.mistral3(tmp_path / "windowed", sliding_window=32)
    with pytest.raises(
        Exception, match=r"does not serve sliding-window attention \(this model's layers attend within 32"
    ):
        LLM(
            model=str(path),
            hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
            **ENGINE,
        )
    LLM(model=str(path), **ENGINE)
