"""Gemma 3 (``Gemma3ForConditionalGeneration``) and vLLM's CPU build: what stock vLLM serves, which the
plug-in's refusal of Gemma 3 rests on (``architectures.UNSERVED``; docs/serving.md, Families).

Transformers lets the tokens of one Gemma 3 image attend to each other in both directions at prefill
(``token_type_ids``); vLLM asks its attention backends for that through multimodal-prefix ranges
(``is_mm_prefix_lm``), which its CPU attention does not implement and its CPU platform does not refuse.
So stock vLLM on CPU attends causally within an image: its answers are transformers' with
``token_type_ids`` withheld, not transformers' own. If a vLLM release gives the CPU backend those
masks, the second test fails, and the refusal's reason is due for another look.
"""

from __future__ import annotations

import pytest
from vllm import LLM

from tests.vllm.checkpoints import GEMMA3_IMAGE, GEMMA3_WINDOW
from tests.vllm.harness import ANSWER_TOKENS, generate
from tests.vllm.reference import ENGINE, hf_tokens, image

IMAGE = "<start_of_image>"
ONE = f"USER: {IMAGE} what is in the image ASSISTANT:"  # 27 tokens with the image's 16 and markers
LONG = f"USER: {IMAGE} {' '.join(['what is in the image'] * 5)} ASSISTANT:"  # 47: past the window


@pytest.fixture(scope="module")
def stock(gemma3_dir):
    engine = LLM(model=str(gemma3_dir), limit_mm_per_prompt={"image": 1}, **ENGINE)
    yield engine
    del engine


CASES = [(prompt, [image(GEMMA3_IMAGE, seed)], None) for prompt in (ONE, LONG) for seed in range(3)]


def test_stock_vllm_on_cpu_attends_causally_within_an_image(stock, gemma3_dir):
    """Every answer of stock vLLM equals transformers' with the image's two-way attention withheld; at
    least one differs from transformers' own (measured: four of the six)."""
    outs = generate(stock, CASES)
    assert len(outs[-1].prompt_token_ids) > GEMMA3_WINDOW  # the long prompts pass the sliding window
    served = [list(out.outputs[0].token_ids) for out in outs]
    causal = [
        hf_tokens(gemma3_dir, p, i, None, ANSWER_TOKENS, withheld=("token_type_ids",)) for p, i, _ in CASES
    ]
    own = [hf_tokens(gemma3_dir, p, i, None, ANSWER_TOKENS) for p, i, _ in CASES]
    assert served == causal
    assert sum(s != o for s, o in zip(served, own, strict=True)) >= 1
