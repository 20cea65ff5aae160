"""Frozen means frozen: a checked configuration's options and a plan's pools (their stages included)
refuse to change, so the one configuration the vLLM plug-in shares across requests, and the plan every
stage reads, are the ones that were checked. The plan's stages come from plain values: one schedule per
pool, checked against the pools (no callback or iterator that could run short)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from priortr.adapters import adapter_for
from priortr.engine.config import PruningConfig
from priortr.engine.plan import plan_on_host, plan_prefill
from tests.helpers.tiny import llava_batch, tiny_llava


@pytest.fixture(scope="module")
def prompt():
    """A tiny LLaVA model and one prompt with two images, text between them."""
    model = tiny_llava(dtype=torch.float32)
    batch = llava_batch(model, images=2)
    adapter = adapter_for(model)
    return model, adapter, batch, len(adapter.decoder_layers(model))


def test_a_configs_options_refuse_to_change_and_are_a_copy():
    given = {"image_pivots": 2}
    config = PruningConfig.of("dart", 8, n_layers=4, options=given)
    with pytest.raises(TypeError):
        config.options["image_pivots"] = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.options = {"image_pivots": 3}
    given["image_pivots"] = 3  # the caller's dict is not the config's
    assert dict(config.options) == {"image_pivots": 2}
    assert PruningConfig.of("priortr", 8, n_layers=4).options == ()


def test_a_plans_pools_and_their_stages_refuse_to_change(prompt):
    model, adapter, batch, n_layers = prompt
    config = PruningConfig.of("priortr", 8, 1, n_layers=n_layers)
    valid = batch.attention_mask.bool()
    for plan in (
        plan_on_host(adapter, model.config, config, batch.input_ids, valid, n_layers),
        plan_prefill(adapter, model.config, config, batch.input_ids, valid, n_layers),
    ):
        assert isinstance(plan.pools, tuple) and isinstance(plan.pool_rows, tuple)
        assert [dict(pool.stages) for pool in plan.pools] == [{1: 4}, {1: 4}]  # 8 split over two images
        with pytest.raises(TypeError):
            plan.pools[0].stages[1] = 2
        with pytest.raises(TypeError):
            plan.pools[0].stages[3] = 2
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.pools[0].stages = {1: 2}


def test_given_counts_are_one_per_pool(prompt):
    """A front end that laid out its counts gives one per pool: too few or too many is an error naming
    the mismatch (a callback reading an iterator used to stop short with StopIteration, or drop the
    extra counts)."""
    model, adapter, batch, n_layers = prompt
    config = PruningConfig.of("priortr", 8, 1, n_layers=n_layers)
    ids, valid = batch.input_ids, batch.attention_mask.bool()
    plan = plan_on_host(adapter, model.config, config, ids, valid, n_layers, counts=[3, 5])
    assert [dict(pool.stages) for pool in plan.pools] == [{1: 3}, {1: 5}]
    for counts in ([3], [3, 5, 2]):
        with pytest.raises(ValueError, match=f"{len(counts)} schedules for 2 pools"):
            plan_on_host(adapter, model.config, config, ids, valid, n_layers, counts=counts)
