"""Gemma 4: what only it does, against the reference that runs each layer on the pruned sequence
(``tests/helpers/pruned_reference.py``). The suites over ``FAMILIES`` cover its three shapes (dense, E2B,
MoE) as every family: prefill, generate with dynamic and static caches, the cache, batches, layouts.

* KV sharing (E2B/E4B): layers 4 and 5 read the keys and values that layers 3 (sliding) and 2 (global)
  stored in the forward's ``shared_kv_states``. Scored at layer 2 or 3, the stage cuts after a storing
  layer ran, so the stored states must be cut with the cache (else the shared layers attend over the
  whole prompt: a shape error, or wrong keys); a second stage cuts states stored after the first.
* Per-layer inputs (E2B/E4B): one [B, S, d] slice per layer, cut with the hidden states.
* The shared layers have no key projection: no method can score them.
* Image tokens attend to each other both ways on the sliding layers only (dense, MoE): the scored
  layer's prior equals its eager attention, window and bidirectional block included.
"""

from __future__ import annotations

import pytest
import torch

import priortr
from tests.families.test_local_and_linear_attention import _attention_weights, _separator_and_rows
from tests.helpers.pruned import generate, kept_rows, logits_atol, pruned_columns, reference_for, stage_masks
from tests.helpers.tiny_gemma4 import E2B_LAYER_TYPES, SHARED, gemma4_batch, tiny_gemma4, tiny_gemma4_e2b

NEW_TOKENS = 8


def test_the_model_is_supported_with_its_shared_layers_named():
    model = tiny_gemma4_e2b()
    adapter = priortr.adapters.adapter_for(model)
    assert adapter.name == "gemma4"
    first_shared = len(E2B_LAYER_TYPES) - SHARED
    assert adapter.kv_shared_layers(model) == {
        index: E2B_LAYER_TYPES[index] for index in range(first_shared, len(E2B_LAYER_TYPES))
    }
    assert adapter.scored_layers(model) == list(range(first_shared))
    assert adapter.kv_shared_layers(tiny_gemma4()) == {}


def test_a_kv_shared_layer_cannot_be_scored_and_the_nearest_is_named():
    model = tiny_gemma4_e2b()
    own_keys = "decoder layer 4 of this model has no softmax attention over keys of its own"
    with pytest.raises(ValueError, match=f"{own_keys}.*score layer 3 instead"):
        priortr.apply(model, budget=4, layer=4)
    with pytest.raises(ValueError, match=f"the layer after the scored one, and {own_keys}.*score layer 2"):
        priortr.apply(model, method="pdrop", stages=[(3, 8)])  # ranks with layer 4, a shared one
    priortr.apply(model, budget=4, layer=3).remove()
    priortr.apply(model, method="pdrop", stages=[(2, 8)]).remove()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize(
    "stages", [[(2, 5)], [(3, 5)], [(1, 10), (3, 5)]], ids=["after 2", "after 3", "two stages"]
)
def test_stages_after_the_layers_that_store_shared_keys_match_the_reference(stages, cache):
    """Scored at the global layer 2 (its stored keys cut, layer 3 stores after the cut), at the sliding
    layer 3 (both stored states cut), and in two stages (the second cuts states stored after the first):
    prefill logits and greedy decoding equal the reference in float64; the stock model differs."""
    model = tiny_gemma4_e2b()
    batch = gemma4_batch(model, 2)
    with priortr.apply(model, method="priortr", stages=stages) as handle, torch.no_grad():
        logits = model(**batch.kwargs()).logits
        result = handle.last
        out = generate(model, batch, NEW_TOKENS, cache_implementation=cache)
    assert [stage.layer for stage in result.stages] == [layer for layer, _ in stages]
    assert torch.equal(handle.last.kept, result.kept)
    with reference_for(model, stage_masks(batch, result), batch.attention_mask), torch.no_grad():
        reference, real = kept_rows(model(**batch.kwargs()).logits, result, batch)
        expected = generate(model, batch, NEW_TOKENS, cache_implementation=cache)
    atol = logits_atol(model)
    torch.testing.assert_close(logits[real], reference[real], atol=atol, rtol=0)
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), atol=atol, rtol=0)
    with torch.no_grad():
        stock = generate(model, batch, NEW_TOKENS, cache_implementation=cache)
    assert (torch.stack(stock.logits) - torch.stack(out.logits)).abs().max() > 1e-6


def test_per_layer_inputs_are_cut_with_the_hidden_states():
    """Each layer after the stage receives the per-layer input of the kept tokens only: the slices of the
    stock model's per-layer inputs at the kept positions (hand-checked on layer 3, after a cut at 1)."""
    model = tiny_gemma4_e2b()
    batch = gemma4_batch(model, 2)
    seen: dict[str, torch.Tensor] = {}
    layer = model.model.language_model.layers[3]

    def keep(name):
        def hook(module, args, kwargs, output):  # the arguments the layer ran with, after every pre-hook
            seen[name] = args[1] if len(args) > 1 else kwargs["per_layer_input"]

        return hook

    handle = layer.register_forward_hook(keep("stock"), with_kwargs=True)
    with torch.no_grad():
        model(**batch.kwargs())
    handle.remove()
    handle = layer.register_forward_hook(keep("pruned"), with_kwargs=True)
    with priortr.apply(model, budget=5, layer=1) as pruning, torch.no_grad():
        model(**batch.kwargs())
    handle.remove()
    positions = pruning.last.positions  # [B, S']
    assert seen["pruned"].shape[1] == positions.shape[1] < seen["stock"].shape[1]
    expected = seen["stock"].gather(1, positions[..., None].expand(-1, -1, seen["stock"].shape[-1]))
    assert torch.equal(seen["pruned"], expected)


def test_the_report_and_the_cache_after_a_pruned_prefill():
    """Global layers hold text + K entries, sliding ones the window's tail of them, shared layers none
    (``shared``: they read layers 2 and 3's); the cache a generate() leaves holds exactly that."""
    model = tiny_gemma4_e2b()
    batch = gemma4_batch(model, 2)
    with priortr.apply(model, budget=5, layer=1) as handle, torch.no_grad():
        out = model.generate(
            **batch.kwargs(), max_new_tokens=1, do_sample=False, return_dict_in_generate=True
        )
    prompt, kept = batch.seq_len, batch.seq_len - batch.n_visual + 5
    text = model.config.get_text_config()
    report = handle.last.cache
    kinds = [{"full_attention": "keys", "sliding_attention": "window"}[kind] for kind in E2B_LAYER_TYPES]
    kinds[-SHARED:] = ["shared"] * SHARED
    assert [entry.kind for entry in report] == kinds
    layers = list(out.past_key_values.layers)
    for index, entry in enumerate(report):
        if entry.kind == "shared":
            assert (entry.unpruned, entry.pruned) == (0, 0)
            assert index >= len(layers) or getattr(layers[index], "keys", None) is None
            continue
        cap = prompt if entry.kind == "keys" else text.sliding_window - 1
        assert (entry.unpruned, entry.pruned) == (min(prompt, cap), min(kept, cap))
        assert layers[index].keys.shape[2] == entry.pruned < entry.unpruned or entry.kind == "window"


@pytest.mark.parametrize(("shape", "layer"), [("dense", 1), ("dense", 2), ("moe", 1), ("e2b", 3)])
def test_prior_and_posterior_are_the_scored_layers_own_attention(shape, layer):
    """Q and P at the scored layer equal those read off its eager attention weights (float32), which on
    the sliding layers of the dense and MoE shapes let an image's tokens attend to each other both ways
    (the separator's row is causal either way) within the window: the separator sees only the image
    tokens within the window (zero prior elsewhere)."""
    eager = tiny_gemma4(attn="eager", dtype=torch.float32, shape=shape)
    batch = gemma4_batch(eager, 2)
    weights = _attention_weights(eager, layer, batch).mean(dim=1)  # [B, S, S], head mean
    visual = batch.visual_mask()[0].nonzero().flatten()
    block = weights[0][visual][:, visual]
    bidirectional = eager.config.get_text_config().use_bidirectional_attention == "vision"
    sliding = E2B_LAYER_TYPES[layer] == "sliding_attention"
    assert bool(block.triu(1).gt(0).any()) == (bidirectional and sliding)
    model = tiny_gemma4(dtype=torch.float32, shape=shape)
    with priortr.apply(model, method="fastv", budget=batch.n_visual, layer=layer) as handle, torch.no_grad():
        model(**batch.kwargs())
    result = handle.last
    for row in range(batch.batch_size):
        visual, separator, rows = _separator_and_rows(batch, row)
        prior = weights[row, separator, visual]
        posterior = weights[row][rows][:, visual].mean(dim=0)
        torch.testing.assert_close(result.prior[row], prior / prior.sum(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result.posterior[row], posterior / posterior.sum(), atol=1e-6, rtol=1e-5)
    if sliding:
        visual, separator, _ = _separator_and_rows(batch, 0)
        outside = visual <= separator - model.config.get_text_config().sliding_window
        assert outside.any() and (result.prior[0][outside] == 0).all()


def test_pruned_columns_are_not_the_kept_ones():
    """The reference's control: hiding the kept tokens instead of the pruned ones gives other logits."""
    model = tiny_gemma4_e2b()
    batch = gemma4_batch(model, 1)
    with priortr.apply(model, budget=5, layer=3) as handle, torch.no_grad():
        logits = model(**batch.kwargs()).logits
    result = handle.last
    wrong = batch.visual_mask() & ~pruned_columns(batch, result.kept)
    with reference_for(model, [(3, wrong)], batch.attention_mask), torch.no_grad():
        other = model(**batch.kwargs()).logits[:, -1]
    assert (other - logits[:, -1]).abs().max() > 1e-6
