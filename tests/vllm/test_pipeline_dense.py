"""Pipeline parallelism 2 of a dense family on vLLM's CPU build (each stage a process on this machine,
the multiprocessing executor), against priortr.apply + HF generate(): LLaVA-1.5, whose positions are
1-D (Qwen3-VL MoE's pipeline, with M-RoPE's three position rows and the negative control of the
positions a later stage runs at, is ``test_moe_parallel.py``'s). The first stage embeds, scores and
cuts; the kept tokens' original positions travel beside the hidden states (``pipeline.py``).
"""

from __future__ import annotations

import pytest

from tests.vllm.family_contract import FAMILIES, check_step, step_cases
from tests.vllm.harness import check_positions_stay_put, ranked_engine


@pytest.fixture(scope="module")
def pipeline(llava_dir):
    """(family row, checkpoint, an engine of two pipeline stages of two decoder layers each: the
    scored layer 1 is the first stage's last)."""
    family = FAMILIES["llava"]
    engine = ranked_engine(llava_dir, family, pipeline_parallel_size=2)
    yield family, llava_dir, engine
    engine.llm_engine.engine_core.shutdown()


def test_pipeline_parallel_2_is_exact(pipeline):
    """One step of pruned prompts (one image, two sharing the budget, a per-request budget), an image
    request that prunes nothing and a text-only one, over two stages; the served prompt lengths show
    which were pruned."""
    family, path, engine = pipeline
    check_step(engine, family, path)


def test_every_stage_runs_at_positions_that_stay_put(pipeline):
    """The second stage copies the positions the first sends into a buffer of its own, laid out as
    vLLM's: a transposed view of the sent rows (stride 3) was read by vLLM's rotary op as other tokens'
    positions, and a copy made anew each step would leave a CUDA graph replaying a freed address."""
    family, _, engine = pipeline
    check_positions_stay_put(engine, step_cases(family))
