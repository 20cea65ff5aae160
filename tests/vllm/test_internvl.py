"""InternVL in the Hugging Face format (``InternVLForConditionalGeneration``: ``<img>`` / ``</img>`` around
each image's ``<IMG_CONTEXT>`` run, its crops and thumbnail in one run) served by vLLM with the plug-in:
the family contract (``family_contract.py``) over InternVL and InternVL3.5 (a Qwen3 language model: q/k
norms before RoPE in the scored attention), and the prompt shrinking InternVL's ranges need.

vLLM's placeholder range of an image spans ``<img> ... </img>`` with an ``is_embed`` mask on the
``<IMG_CONTEXT>`` tokens; the two markers stay text. The tiny checkpoint's tiles are 56 px and 16 tokens:
a 56x56 image is one tile (16 tokens), 112x56 two crops and a thumbnail (48), 112x112 four crops and
a thumbnail (80).
"""

from __future__ import annotations

import torch
from vllm.multimodal.inputs import PlaceholderRange

from priortr.integrations.vllm.request_records import embedded_tokens, shrink_prompt
from tests.vllm.family_contract import INTERNVL_ONE, INTERNVL_TWO, FamilyContract, answers, expected
from tests.vllm.harness import generate
from tests.vllm.reference import image


class TestInternVL(FamilyContract):
    family = "internvl"

    def test_four_crops_and_the_thumbnail(self, llm, row, path):
        """A 112x112 image (four crops and the thumbnail, 80 tokens: the contract's images are 16 and 48),
        alone and sharing the budget with a tile, answers as apply does."""
        cases = [(INTERNVL_ONE, [image(112, 0)], None), (INTERNVL_TWO, [image(112, 1), image(56, 2)], None)]
        outs = generate(llm, cases)
        assert answers(outs) == [expected(row, path, case) for case in cases]
        assert [len(out.prompt_token_ids) for out in outs] == [9 + 8, 12 + 8]


class TestInternVL3_5(FamilyContract):
    family = "internvl3.5"


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
