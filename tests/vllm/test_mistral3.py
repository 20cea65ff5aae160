"""Mistral 3 (``Mistral3ForConditionalGeneration``: a Pixtral tower at the image's own aspect ratio) served
by vLLM with the plug-in: the family contract (``family_contract.py``), and the row breaks, positions and
refusals that are Mistral 3's own.

vLLM lays out an image of ``rows x cols`` tokens as ``PixtralProcessor`` writes it: ``[IMG] x cols
[IMG_BREAK]`` per row, the last break replaced by ``[IMG_END]``, one placeholder range whose ``is_embed``
mask marks the ``[IMG]`` tokens. ``priortr.apply`` keeps K of the ``[IMG]`` tokens and every row break;
a pruned prompt holds K ``[IMG]`` slots, then the row breaks and ``[IMG_END]`` (the contract's
``layouts``). The tiny checkpoint's tokens are 16 x 16 px.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm import LLM
from vllm.multimodal.inputs import PlaceholderRange

from priortr.integrations.vllm.decoder import check_options
from priortr.integrations.vllm.positions import ImageSlots, linear_positions, request_positions
from priortr.integrations.vllm.request_records import embedded_tokens, shrink_prompt
from priortr.integrations.vllm.served_families import MISTRAL3_LAYOUT
from tests.helpers.tiny_mistral3 import MISTRAL3_BREAK_ID, MISTRAL3_END_ID, MISTRAL3_IMAGE_ID
from tests.vllm import checkpoints
from tests.vllm.family_contract import FAMILIES, FamilyContract
from tests.vllm.reference import ENGINE

IMG, BREAK, END = MISTRAL3_IMAGE_ID, MISTRAL3_BREAK_ID, MISTRAL3_END_ID


class TestMistral3(FamilyContract):
    family = "mistral3"


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
    breaks = MISTRAL3_LAYOUT.breaks
    assert breaks((2, 2)) == (2,) and breaks((3, 4)) == (4, 8) and breaks((1, 5)) == ()
    short = [5, IMG, IMG, BREAK, END, 6]
    slots = ImageSlots(offset=1, kept_count=2, tokens=4, grid=(2, 2), breaks=breaks((2, 2)))
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
            hf_overrides=FAMILIES["mistral3"].overrides(),
            **ENGINE,
        )
    LLM(model=str(path), **ENGINE)
