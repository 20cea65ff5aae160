"""GLM-4.1V (M-RoPE as Qwen2-VL's; a GLM-4 language model with sandwich norms and RoPE over half of each
head) served by vLLM with the plug-in: the family contract (``family_contract.py``) and GLM-4.1V's own
check, on one engine, against priortr.apply + HF generate()."""

from __future__ import annotations

import pytest

from tests.vllm.family_contract import FamilyContract
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
