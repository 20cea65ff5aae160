"""Llama 4: its image layout (tiles, tile separators and the global view between ``<|image_start|>`` and
``<|image_end|>``), and the attention temperature of its global NoPE layers after pruning.

A NoPE layer multiplies its queries by ``1 + attn_scale * log1p(floor((i + 1) / floor_scale))``, ``i`` the
query's place in the sequence the layer runs on. In the unpruned model with the pruned tokens masked (the
reference) a token keeps its place in the prompt; after physical pruning the layer would count kept tokens
instead (the cache is shorter). priortr gives every kept token the temperature of its place in the prompt,
in the prefill (after the scored layer), in the scored layer's own evidence and in every decode step. The
released ``floor_scale`` is 8192 (the temperature is 1 below that); these tests use 3, so that it changes
every three tokens of a tiny prompt.
"""

from __future__ import annotations

import pytest
import torch

import priortr
from priortr.adapters.llama4 import Llama4Adapter
from priortr.engine import hooks
from tests.families.test_local_and_linear_attention import _attention_weights, _separator_and_rows
from tests.helpers.families import skip_unless_stock_runs_static
from tests.helpers.pruned import generate, kept_rows, logits_atol, pruned_columns, reference_for
from tests.helpers.tiny_llama4 import (
    LLAMA4_END_ID,
    LLAMA4_GLOBAL_ID,
    LLAMA4_PATCH_ID,
    LLAMA4_START_ID,
    LLAMA4_TILE_X_ID,
    LLAMA4_TILE_Y_ID,
    TILE_TOKENS,
    llama4_batch,
    llama4_multi_image_batch,
    tiny_llama4,
)

FLOOR_SCALE = 3
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model():
    return tiny_llama4(floor_scale=FLOOR_SCALE)


def test_an_image_is_its_patch_tokens_closed_by_image_end(model):
    """Tiles and the global view are one item: every ``<|patch|>`` between ``<|image_start|>`` and
    ``<|image_end|>``; the tile separators and ``<|image|>`` stay text; the separator is ``<|image_end|>``."""
    adapter = Llama4Adapter()
    batch = llama4_multi_image_batch(model, 2)
    items = adapter.visual_items(model.config, batch.input_ids)
    assert [item.row for item in items] == [0, 0, 1, 1]
    assert [item.size for item in items] == [3 * TILE_TOKENS, TILE_TOKENS] * 2
    for item in items:
        ids = batch.input_ids[item.row]
        assert (ids[item.positions] == LLAMA4_PATCH_ID).all()
        assert int(ids[item.separator]) == LLAMA4_END_ID
        start = int(item.positions[0]) - 1
        while int(ids[start]) != LLAMA4_START_ID:
            assert int(ids[start]) in (LLAMA4_GLOBAL_ID, LLAMA4_TILE_X_ID, LLAMA4_TILE_Y_ID, LLAMA4_PATCH_ID)
            start -= 1
        inside = torch.arange(start, item.separator)
        assert torch.equal(inside[ids[inside] == LLAMA4_PATCH_ID], item.positions)


def test_a_prompt_off_the_layout_is_refused(model):
    ids = llama4_batch(model, 1).input_ids
    end = int((ids[0] == LLAMA4_END_ID).nonzero())
    unclosed = ids.clone()
    unclosed[0, end] = 5
    with pytest.raises(ValueError, match="not closed by <\\|image_end\\|>"):
        Llama4Adapter().visual_items(model.config, unclosed)
    unopened = ids.clone()
    unopened[unopened == LLAMA4_START_ID] = 5
    with pytest.raises(ValueError, match="do not follow an <\\|image_start\\|>"):
        Llama4Adapter().visual_items(model.config, unopened)


def _pruned_and_reference(model, batch, cache: str) -> tuple:
    """(pruned prefill logits, pruned generate, reference logits, reference generate, real rows)."""
    with priortr.apply(model, budget=5, layer=1) as handle, torch.no_grad():
        logits = model(**batch.kwargs()).logits
        result = handle.last
        out = generate(model, batch, NEW_TOKENS, cache_implementation=cache)
    assert torch.equal(handle.last.kept, result.kept)
    pruned = pruned_columns(batch, result.kept)
    with reference_for(model, [(1, pruned)], batch.attention_mask), torch.no_grad():
        reference, real = kept_rows(model(**batch.kwargs()).logits, result, batch)
        expected = generate(model, batch, NEW_TOKENS, cache_implementation=cache)
    return logits, out, reference, expected, real


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_the_temperature_follows_the_prompts_places(model, cache):
    """Pruned at the NoPE layer 1 (a left-padded batch of two), the prefill and every decode step equal
    the reference, whose temperature follows each token's place in the prompt."""
    if cache == "static":
        skip_unless_stock_runs_static(model)
    batch = llama4_batch(model, 2)
    logits, out, reference, expected, real = _pruned_and_reference(model, batch, cache)
    atol = logits_atol(model)
    torch.testing.assert_close(logits[real], reference[real], atol=atol, rtol=0)
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), atol=atol, rtol=0)


def test_the_temperature_of_kept_token_counts_is_caught(model, monkeypatch):
    """Negative controls: with the layers' own count of kept tokens (no rescaling anywhere) the prefill
    differs from the reference; with the prefill rescaled but decode steps counting the shorter cache,
    the decode steps differ."""
    batch = llama4_batch(model, 2)
    with monkeypatch.context() as patch:
        patch.setattr(Llama4Adapter, "scales_queries", lambda self, attention: False)
        logits, _, reference, _, real = _pruned_and_reference(model, batch, "dynamic")
    assert (logits[real] - reference[real]).abs().max() > 1e-4
    with monkeypatch.context() as patch:
        patch.setattr(hooks, "_places_in_prompt", lambda module, args, kwargs: None)
        logits, out, reference, expected, real = _pruned_and_reference(model, batch, "dynamic")
    torch.testing.assert_close(logits[real], reference[real], atol=logits_atol(model), rtol=0)
    assert (torch.stack(out.logits) - torch.stack(expected.logits)).abs().max() > 1e-4


def test_the_scored_nope_layers_evidence_has_its_temperature():
    """Q and P at the NoPE layer 1 equal those read off its eager attention weights, which include the
    temperature of each query's place (float32: eager float64 turns padded rows into NaN)."""
    eager = tiny_llama4(attn="eager", dtype=torch.float32, floor_scale=FLOOR_SCALE)
    batch = llama4_batch(eager, 2)
    weights = _attention_weights(eager, 1, batch).mean(dim=1)  # [B, S, S], head mean
    model = tiny_llama4(dtype=torch.float32, floor_scale=FLOOR_SCALE)
    with priortr.apply(model, method="fastv", budget=batch.n_visual, layer=1) as handle, torch.no_grad():
        model(**batch.kwargs())
    result = handle.last
    for row in range(batch.batch_size):
        visual, separator, rows = _separator_and_rows(batch, row)
        prior = weights[row, separator, visual]
        posterior = weights[row][rows][:, visual].mean(dim=0)
        torch.testing.assert_close(result.prior[row], prior / prior.sum(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result.posterior[row], posterior / posterior.sum(), atol=1e-6, rtol=1e-5)
    plain = tiny_llama4(attn="eager", dtype=torch.float32)  # floor_scale 8192: no temperature here
    unscaled = _attention_weights(plain, 1, batch).mean(dim=1)
    prior = unscaled[0, _separator_and_rows(batch, 0)[1], _separator_and_rows(batch, 0)[0]]
    assert (result.prior[0] - prior / prior.sum()).abs().max() > 1e-4
