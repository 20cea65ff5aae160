"""GLM-4.1V (M-RoPE as Qwen2-VL's; a GLM-4 language model with sandwich norms and RoPE over half of each
head) served by vLLM with the plug-in: the family contract (``family_contract.py``) and GLM-4.1V's own
checks, on one engine, against priortr.apply + HF generate()."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.vllm.family_contract import FamilyContract, answers, expected, step_cases
from tests.vllm.harness import generate
from tests.vllm.reference import image


class TestGlm4v(FamilyContract):
    family = "glm4v"

    def test_adjacent_images_are_refused_with_the_reason(self, llm):
        """GLM-4.1V's processor wraps every image in ``<|begin_of_image|>`` ... ``<|end_of_image|>``; two
        ``<|image|>`` in one pair (a raw prompt) are one run for priortr.apply, whose M-RoPE positions
        the plug-in has not checked: refused in the front end, with the reason and the fix."""
        adjacent = (
            "USER: <|begin_of_image|><|image|><|image|><|end_of_image|> what is in the image ASSISTANT:"
        )
        with pytest.raises(
            ValueError, match=r"never writes two images back to back.*put text between images"
        ):
            generate(llm, [(adjacent, [image(56, 7), image(56, 8)], None)])

    def test_prefill_without_the_sandwich_norms_is_caught(self, llm, row, path):
        """Negative control: the pruned prefill's layers 0..L run without GLM-4's norms of the
        attention's and the MLP's outputs (``decoder.SANDWICH_NORM_LAYERS``) answer otherwise."""

        def sandwich(on: bool) -> Callable[[Any], None]:
            def switch(model: Any) -> None:
                for parts in model._served.scored:
                    parts.sandwich_norms = on

            return switch

        case = step_cases(row)[0]
        llm.apply_model(sandwich(False))
        try:
            assert answers(generate(llm, [case])) != [expected(row, path, case)]
        finally:
            llm.apply_model(sandwich(True))
        assert answers(generate(llm, [case])) == [expected(row, path, case)]
