"""The stage core (``priortr.engine.stage.run_stage``) is values in, values out: it edits neither the plan
nor the state it is given, gives the same outcome when run again on them, keeps what the method chose, and
runs its checks whichever front end calls it (the vLLM plug-in calls it as ``priortr.apply``'s prefill does).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from priortr.adapters import adapter_for
from priortr.engine.config import BEFORE_LLM, PruningConfig
from priortr.engine.evidence import Sources
from priortr.engine.plan import plan_prefill
from priortr.engine.stage import run_stage
from priortr.engine.state import StageState
from priortr.methods.selection import Selection
from tests.helpers.tiny import llava_batch, tiny_llava

BUDGET = 4


@pytest.fixture(scope="module")
def stage_inputs():
    """A batch of two tiny LLaVA prompts planned for DivPrune (one stage before the language model), and
    hidden states [B, S, D] to run that stage on."""
    model = tiny_llava(dtype=torch.float32)
    batch = llava_batch(model, batch_size=2)
    adapter = adapter_for(model)
    n_layers = len(adapter.decoder_layers(model))
    config = PruningConfig.of("divprune", BUDGET, n_layers=n_layers)
    valid = batch.attention_mask.bool()
    plan = plan_prefill(adapter, model.config, config, batch.input_ids, valid, n_layers)
    hidden = torch.randn(*batch.input_ids.shape, model.config.text_config.hidden_size)
    return plan, config, hidden, batch


def _run(plan, config, hidden):
    state = StageState.of_prompt(plan)
    return state, run_stage(BEFORE_LLM, Sources(plan, state, config, hidden=hidden), hidden)


def test_a_stage_edits_none_of_its_inputs_and_gives_the_same_outcome_again(stage_inputs):
    plan, config, hidden, batch = stage_inputs
    positions = [pool.positions.clone() for pool in plan.pools]
    given = hidden.clone()
    state, outcome = _run(plan, config, hidden)
    assert state.pools is plan.pools
    for pool, before in zip(plan.pools, positions, strict=True):
        assert torch.equal(pool.positions, before)
    assert state.sequence.positions is None and torch.equal(hidden, given)
    assert outcome.state is not state
    assert [pool.size for pool in outcome.state.pools] == [BUDGET] * batch.batch_size
    _, again = _run(plan, config, hidden)
    assert torch.equal(again.hidden, outcome.hidden)
    assert torch.equal(again.state.sequence.positions, outcome.state.sequence.positions)


def test_a_stage_keeps_the_methods_choice_and_every_text_token(stage_inputs):
    plan, config, hidden, batch = stage_inputs
    _, outcome = _run(plan, config, hidden)
    positions = outcome.state.sequence.positions  # [B, S'] prompt position of every kept column
    visual = batch.visual_mask()
    for row in range(batch.batch_size):
        chosen = (
            outcome.decisions[0].group.positions[row].gather(0, outcome.decisions[0].selection.indices[row])
        )
        kept_visual = positions[row][visual[row].gather(0, positions[row])]
        assert torch.equal(kept_visual, chosen)
        text = torch.arange(batch.seq_len)[~visual[row]]
        assert torch.equal(positions[row][~visual[row].gather(0, positions[row])], text)
    index = positions[..., None].expand(-1, -1, hidden.shape[-1])
    assert torch.equal(outcome.hidden, hidden.gather(1, index))


def test_a_stage_refuses_a_selection_larger_than_its_group_on_every_front_end(stage_inputs):
    """Negative control: the check belongs to the core, so a caller that only runs ``run_stage`` (the vLLM
    step) gets it too."""
    plan, config, hidden, _ = stage_inputs

    def too_many(inputs):
        batch, n_visual = inputs.hidden.shape[:2]
        return Selection(indices=torch.arange(n_visual + 1).expand(batch, -1))

    method = dataclasses.replace(config.method, select=too_many, name="too_many")
    with pytest.raises(ValueError, match=r"kept .* visual tokens for 2 images"):
        _run(plan, dataclasses.replace(config, method=method), hidden)
