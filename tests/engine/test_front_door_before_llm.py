"""The front door's pre-LLM half (issue 57): the slots ``kept_runs`` lays out for a method that keeps
another count than its budget (VisionZip's [CLS] slot), and ``kept_before_llm`` keeping what
``priortr.apply``'s stage keeps from the same embeddings."""

from __future__ import annotations

import pytest
import torch

from priortr.adapters import adapter_for
from priortr.engine.config import BEFORE_LLM, PruningConfig
from priortr.engine.evidence import Sources
from priortr.engine.front_door import kept_before_llm, kept_runs
from priortr.engine.plan import plan_prefill
from priortr.engine.stage import run_stage
from priortr.engine.state import StageState
from tests.helpers.tiny import llava_batch, tiny_llava


@pytest.fixture(scope="module")
def llava():
    model = tiny_llava(dtype=torch.float32)
    batch = llava_batch(model, images=2)
    return (
        model,
        adapter_for(model),
        batch.input_ids[0].tolist(),
        len(adapter_for(model).decoder_layers(model)),
    )


def test_visionzip_lays_out_one_slot_fewer_and_ranks_under_the_budget(llava):
    """VisionZip's K counts [CLS]: a run keeps K - 1, the slots map back to K, and a run left with no
    patch is refused; DivPrune keeps its K."""
    model, adapter, prompt, n_layers = llava
    zip_config = PruningConfig.of("visionzip", 6, n_layers=n_layers)
    assert [run.kept_count for run in kept_runs(adapter, model.config, zip_config, prompt)] == [2, 2]
    assert zip_config.kept_count(3, 16) == 2 and zip_config.budget_for(2, 16) == 3
    assert zip_config.kept_count(16, 16) == 16 and zip_config.budget_for(16, 16) == 16
    plain = PruningConfig.of("visionzip", 6, n_layers=n_layers, options={"cls_takes_a_slot": False})
    assert [run.kept_count for run in kept_runs(adapter, model.config, plain, prompt)] == [3, 3]
    with pytest.raises(ValueError, match="keeps no token of a run of 16 at a budget of 1"):
        kept_runs(adapter, model.config, PruningConfig.of("visionzip", 2, n_layers=n_layers), prompt)
    divprune = PruningConfig.of("divprune", 6, n_layers=n_layers)
    assert [run.kept_count for run in kept_runs(adapter, model.config, divprune, prompt)] == [3, 3]


def test_kept_before_llm_keeps_what_the_stage_keeps(llava):
    """The front door's survivors and their embeddings are the stage core's on the same prompt."""
    model, adapter, prompt, n_layers = llava
    config = PruningConfig.of("divprune", 6, n_layers=n_layers)
    embeddings = torch.randn(len(prompt), model.config.text_config.hidden_size)
    counts = [run.kept_count for run in kept_runs(adapter, model.config, config, prompt)]
    columns, kept = kept_before_llm(adapter, model.config, config, prompt, counts, embeddings, None)
    ids = torch.tensor([prompt])
    plan = plan_prefill(adapter, model.config, config, ids, torch.ones_like(ids, dtype=torch.bool), n_layers)
    state = StageState.of_prompt(plan)
    outcome = run_stage(BEFORE_LLM, Sources(plan, state, config, hidden=embeddings[None]), embeddings[None])
    assert torch.equal(columns, outcome.state.sequence.positions[0])
    assert torch.equal(kept, outcome.hidden[0])
    assert columns.numel() == len(prompt) - 32 + sum(counts)
