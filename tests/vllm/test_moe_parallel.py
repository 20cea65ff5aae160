"""Scale-out of Qwen3-VL MoE on vLLM's CPU build, where each rank is a process on this machine: tensor
parallelism 2, pipeline parallelism 2 and both (four ranks; offline ``LLM``, the multiprocessing
executor), against priortr.apply + HF generate(), with a negative control of the positions a later
pipeline stage runs at. Data and expert parallelism are refused (``config_hooks.moe_refusals``; vLLM's
CPU build runs neither for a stock MoE step).
"""

from __future__ import annotations

import pytest
import torch

from tests.vllm.family_contract import FAMILIES, answers, check_step, expected, step_cases
from tests.vllm.harness import check_positions_stay_put, generate, ranked_engine


@pytest.fixture(scope="module")
def moe_tp_llm(qwen3_vl_moe_dir):
    """Two tensor-parallel ranks, eager."""
    family = FAMILIES["qwen3-vl-moe"]
    engine = ranked_engine(qwen3_vl_moe_dir, family, tensor_parallel_size=2, enforce_eager=True)
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def moe_pp_llm(qwen3_vl_moe_dir):
    """Two pipeline stages of two decoder layers each, the scored layer 1 the first stage's last."""
    engine = ranked_engine(qwen3_vl_moe_dir, FAMILIES["qwen3-vl-moe"], pipeline_parallel_size=2)
    yield engine
    engine.llm_engine.engine_core.shutdown()


def _stages_use_own_positions(worker: object) -> None:
    """Fault, run in each worker: a later stage runs at the positions its own runner scheduled (for a
    pruned prompt's rows, the placeholders' records), not those the first stage sent. They are written
    into the sent tensor: handed the runner's own tensor (other strides), the stage's compiled forward,
    traced with the sent one and run by vLLM without guards, changed every answer, text-only ones too."""
    from priortr.integrations.vllm import models, pipeline

    def own(intermediate_tensors: object, positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        sent = pipeline.received_positions(intermediate_tensors, positions, rows)
        return sent if sent is positions else sent.copy_(positions)

    models.received_positions = own


def _stages_use_sent_positions(worker: object) -> None:
    """Undo ``_stages_use_own_positions``."""
    from priortr.integrations.vllm import models, pipeline

    models.received_positions = pipeline.received_positions


def test_moe_tensor_parallel_2_is_exact(moe_tp_llm, qwen3_vl_moe_dir):
    """Qwen3-VL MoE at tensor parallelism 2: each rank holds half of every expert and half the heads,
    and every rank runs the same MoE block calls in the same order (the pruned prompts whole through
    layers 0..L, then the step's rows), each reduced across the ranks. One step holds pruned prompts
    (one image, two images sharing the budget, a wider per-request budget), an image request that
    prunes nothing and a text-only one; the served prompt lengths show which were pruned."""
    check_step(moe_tp_llm, FAMILIES["qwen3-vl-moe"], qwen3_vl_moe_dir)


def test_moe_pipeline_parallel_2_is_exact(moe_pp_llm, qwen3_vl_moe_dir):
    """Qwen3-VL MoE over two pipeline stages: the first embeds, scores and cuts, and sends the kept
    tokens' original positions beside the hidden states (``pipeline.py``); the second runs layers 2-3
    at them. The step of ``test_moe_tensor_parallel_2_is_exact``, against priortr.apply."""
    check_step(moe_pp_llm, FAMILIES["qwen3-vl-moe"], qwen3_vl_moe_dir)


def test_moe_pipeline_stage_at_scheduled_positions_is_caught(moe_pp_llm, qwen3_vl_moe_dir):
    """Negative control: the second stage runs at the positions its own runner scheduled, for a pruned
    prompt's rows the placeholders' records, not the kept tokens' positions the first stage sent; the
    two-image pruned answer must differ from apply's, the unpruned one must not (its positions are the
    same on both stages). On this checkpoint the one-image prompt's answer does not change."""
    family = FAMILIES["qwen3-vl-moe"]
    pruned, unpruned = step_cases(family)[1], step_cases(family)[3]
    moe_pp_llm.collective_rpc(_stages_use_own_positions)
    try:
        outs = answers(generate(moe_pp_llm, [pruned, unpruned]))
    finally:
        moe_pp_llm.collective_rpc(_stages_use_sent_positions)
    assert outs[0] != expected(family, qwen3_vl_moe_dir, pruned)
    assert outs[1] == expected(family, qwen3_vl_moe_dir, unpruned)


def test_moe_stages_run_at_positions_that_stay_put(moe_pp_llm):
    """M-RoPE's three position rows on both stages: at one address every step, each row contiguous,
    as a CUDA graph replay needs (``test_pipeline_dense.py`` checks LLaVA's 1-D positions)."""
    check_positions_stay_put(moe_pp_llm, step_cases(FAMILIES["qwen3-vl-moe"]))


class TestPipelineByTensor:
    """PP 2 x TP 2 in a class of its own: its engine (four workers) is torn down after its test, and
    pytest-xdist's ``loadscope`` may run it beside the module's other engines."""

    @pytest.fixture(scope="class")
    @classmethod
    def moe_pp_tp_llm(cls, qwen3_vl_moe_dir):
        """Two pipeline stages, each over two tensor-parallel ranks: four worker processes."""
        family = FAMILIES["qwen3-vl-moe"]
        engine = ranked_engine(qwen3_vl_moe_dir, family, pipeline_parallel_size=2, tensor_parallel_size=2)
        yield engine
        engine.llm_engine.engine_core.shutdown()

    def test_moe_pipeline_2_by_tensor_2_is_exact(self, moe_pp_tp_llm, qwen3_vl_moe_dir):
        """Four ranks: each pipeline stage's two tensor-parallel ranks hold half of every expert and
        head; the first stage's ranks plan and cut alike, and each hands its rows to the second stage
        with the kept tokens' positions. The step of ``test_moe_tensor_parallel_2_is_exact``, against
        priortr.apply."""
        check_step(moe_pp_tp_llm, FAMILIES["qwen3-vl-moe"], qwen3_vl_moe_dir)
