"""LLaVA-OneVision and LLaVA-NeXT (AnyRes crops, a newline feature after every grid row; the plug-in
serves both with one mixin, ``models.AnyResImages``) served by vLLM with the plug-in: the family
contract (``family_contract.py``) and the adjacent-image runs both families' prompts hold, on one
engine per family, against priortr.apply + HF generate().

The tiny checkpoints' crops are 28 px and 16 tokens: a 28x28 image is 36 tokens (base crop 16, one
4x4 crop and 4 newlines), 56x28 is 52 (a 4x8 grid), 56x56 is 88 (8x8 and 8 newlines). The newline
rows are visual tokens of the image's run, pruned like the others. Two images with no text between
them (LLaVA-OneVision's chat template) are one run under one budget, as ``priortr.apply`` prunes them;
a negative control splits a run's budget per image and the answer must then differ.
"""

from __future__ import annotations

import pytest

from priortr.integrations.vllm import processor
from tests.vllm.family_contract import FamilyContract, answers, expected, step_cases
from tests.vllm.harness import ANSWER_TOKENS, generate, split_run_budget
from tests.vllm.reference import hf_tokens, image

ADJACENT = "USER: <image><image> what is in the image ASSISTANT:"  # 7 text tokens
"""Two images back to back, as LLaVA-OneVision's llava-hf chat template writes a message's images."""
ADJACENT_CASES = [
    (ADJACENT, [image(56, 30, height=28), image(28, 31)], None),  # 52 + 36 tokens, one run keeps 8
    (ADJACENT, [image(28, 32), image(56, 33)], {"budget": 40}),  # 36 + 88: the first image's slots all kept
]


class AdjacentRuns(FamilyContract):
    """Runs of adjacent images, each under one budget."""

    def test_adjacent_images_are_one_run_under_one_budget(self, llm, row, path):
        """Images with no text between them are one run of placeholders, which priortr.apply prunes as
        one item (one budget, one separator after the run); the plug-in keeps the run's K in the images'
        slots (``processor.split_run``), in a step with a request whose images have text between them."""
        cases = [*ADJACENT_CASES, step_cases(row)[1]]
        outs = generate(llm, cases)
        for index, (case, answer) in enumerate(zip(cases, answers(outs), strict=True)):
            assert answer == expected(row, path, case), index
        assert [len(out.prompt_token_ids) for out in outs] == [7 + 8, 7 + 40, 8 + 8]
        for case, answer in zip(ADJACENT_CASES, answers(outs)[:2], strict=True):  # pruning changed them
            assert hf_tokens(path, *case[:2], None, ANSWER_TOKENS) != answer

    def test_adjacent_images_answer_alike_whichever_image_holds_the_slots(self, llm, row, path, monkeypatch):
        """The run's kept tokens fill its images' slots in prompt order, whichever image vLLM counts them
        under: the last image taking the slots first gives apply's answer too."""
        original = processor.split_run
        monkeypatch.setattr(processor, "split_run", lambda kept, tokens: original(kept, tokens[::-1])[::-1])
        case = ADJACENT_CASES[0]
        assert answers(generate(llm, [case])) == [expected(row, path, case)]

    def test_budget_split_per_image_is_caught(self, llm, row, path, monkeypatch):
        """Negative control: the run's budget of 8 split over its images in proportion to their tokens
        (52 : 36, so 5 + 3), each image keeping its own top tokens by the run's scores, changes the
        answer."""
        split_run_budget(monkeypatch, sizes=(52, 36), shares=(5, 3))
        case = ADJACENT_CASES[0]
        assert answers(generate(llm, [case])) != [expected(row, path, case)]

    def test_run_keeping_fewer_tokens_than_its_images_is_refused(self, llm):
        """vLLM places an image on at least one token: a run of two images keeping one is refused."""
        with pytest.raises(ValueError, match="ask for a larger budget, or put text between images"):
            generate(llm, [(ADJACENT, [image(28, 7), image(28, 8)], {"budget": 1})])


class TestLlavaOnevision(AdjacentRuns):
    family = "llava-onevision"


class TestLlavaNext(AdjacentRuns):
    family = "llava-next"


def test_split_run_fills_the_images_in_order():
    """Hand-computed splits: each image 1 to N slots, the first images filled first, the sum the run's K."""
    assert processor.split_run(8, [52, 36]) == [7, 1]
    assert processor.split_run(40, [36, 88]) == [36, 4]
    assert processor.split_run(5, [2, 2, 3]) == [2, 2, 1]
    assert processor.split_run(3, [2, 2, 3]) == [1, 1, 1]
    assert processor.split_run(6, [16]) == [6]
    with pytest.raises(ValueError, match="keeps 1 tokens of a run of 2 images"):
        processor.split_run(1, [16, 16])
