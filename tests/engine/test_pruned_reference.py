"""Tests of the reference for models with sliding-window and linear-attention layers
(``tests/helpers/pruned_reference.py``), before anything is compared to it.

It must (a) be the stock model when nothing is pruned, (b) change the output when something is, (c)
equal the masked reference where both apply (full attention), and (d) equal physically removing the
pruned tokens where that is easy to build by hand: pruning before layer 0 (rerun the language model on
the kept embeddings with their original positions; a sliding window then counts original positions,
so the hand-built run gets masks written from them) and, for the hybrid model, pruning after the last
layer (drop the pruned entries from the full-attention layers' caches of a stock prefill, leave the
linear-attention states, decode). All in float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.families import setup
from tests.helpers.oracle import masked_reference
from tests.helpers.pruned_reference import pruned_reference
from tests.helpers.tiny import Batch, language_model_inputs
from tests.helpers.tiny_gemma3 import gemma3_batch, tiny_gemma3
from tests.helpers.tiny_qwen3_5 import FULL_ATTENTION_LAYERS, LAYER_TYPES

ATOL = 1e-10
FAMILIES = ["qwen3.5", "gemma3"]


def _prune_thirds(batch: Batch) -> torch.BoolTensor:
    """[B, S] True on two of every three visual tokens (the same count in every row)."""
    visual = batch.visual_mask()
    pruned = visual.clone()
    for row in range(visual.shape[0]):
        pruned[row, visual[row].nonzero().flatten()[::3]] = False
    return pruned


def _generate(model, batch: Batch, cache: str = "dynamic", stages: Any = None):
    kwargs = {
        "max_new_tokens": 4,
        "min_new_tokens": 4,
        "do_sample": False,
        "output_logits": True,
        "return_dict_in_generate": True,
        "cache_implementation": cache,
    }
    if stages is None:
        return model.generate(**batch.kwargs(), **kwargs)
    with pruned_reference(model, stages, batch.attention_mask):
        return model.generate(**batch.kwargs(), **kwargs)


def _logits(model, batch: Batch, stages: Any = None) -> torch.Tensor:
    with torch.no_grad():
        if stages is None:
            return model(**batch.kwargs()).logits
        with pruned_reference(model, stages, batch.attention_mask):
            return model(**batch.kwargs()).logits


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_nothing_pruned_is_stock(family, cache):
    model, batch = setup(family, 2)
    none = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    valid = batch.attention_mask.bool()
    torch.testing.assert_close(
        _logits(model, batch, [(1, none)])[valid], _logits(model, batch)[valid], atol=ATOL, rtol=0
    )
    stock, ref = _generate(model, batch, cache), _generate(model, batch, cache, [(1, none)])
    assert torch.equal(ref.sequences, stock.sequences)
    torch.testing.assert_close(torch.stack(ref.logits), torch.stack(stock.logits), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_changes_the_prefill_and_the_decode(family):
    model, batch = setup(family, 2)
    pruned = _prune_thirds(batch)
    stock, ref = _logits(model, batch), _logits(model, batch, [(1, pruned)])
    assert (ref[:, -1] - stock[:, -1]).abs().amax(-1).min() > 1e-6
    last = len(model.config.get_text_config().layer_types) - 1
    gen_stock, gen_ref = _generate(model, batch), _generate(model, batch, stages=[(last, pruned)])
    torch.testing.assert_close(gen_ref.logits[0], gen_stock.logits[0], atol=ATOL, rtol=0)
    assert (gen_ref.logits[1] - gen_stock.logits[1]).abs().amax(-1).min() > 1e-6


@pytest.mark.parametrize("family", ["llava", "mistral3"])
def test_equals_the_masked_reference_on_full_attention(family):
    model, batch = setup(family, 2)
    pruned = _prune_thirds(batch)
    keep = batch.attention_mask.bool() & ~pruned
    with masked_reference(model, 1, pruned, batch.attention_mask), torch.no_grad():
        masked = model(**batch.kwargs()).logits
    torch.testing.assert_close(_logits(model, batch, [(1, pruned)])[keep], masked[keep], atol=ATOL, rtol=0)
    with masked_reference(model, 1, pruned, batch.attention_mask):
        expected = _generate(model, batch, "static")
    ref = _generate(model, batch, "static", [(1, pruned)])
    assert torch.equal(ref.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(ref.logits), torch.stack(expected.logits), atol=ATOL, rtol=0)


def _kept_index(pruned: torch.BoolTensor) -> torch.LongTensor:
    batch, seq = pruned.shape
    return torch.arange(seq).expand(batch, -1)[~pruned].view(batch, -1)


def test_hybrid_prune_before_layer0_equals_removal():
    """Qwen3.5, L = -1: the linear-attention layers and the full-attention layers all see the kept tokens
    only, as if the pruned ones were never in the prompt (kept tokens keep their M-RoPE positions)."""
    model, batch = setup("qwen3.5", 2)
    pruned = _prune_thirds(batch)
    seen = language_model_inputs(model, batch)
    index = _kept_index(pruned)
    embeds = seen["inputs_embeds"].gather(1, index[..., None].expand(-1, -1, seen["inputs_embeds"].shape[-1]))
    positions = seen["position_ids"]  # [4, B, S]
    positions = positions.gather(-1, index.expand(positions.shape[0], -1, -1))
    mask = batch.attention_mask.gather(1, index)
    with torch.no_grad():
        hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask)
        removed = model.lm_head(hidden.last_hidden_state)
    ref = _logits(model, batch, [(-1, pruned)]).gather(1, index[..., None].expand(-1, -1, removed.shape[-1]))
    valid = mask.bool()
    torch.testing.assert_close(ref[valid], removed[valid], atol=ATOL, rtol=0)


def test_sliding_window_counts_original_positions():
    """Gemma 3, L = -1: the reference equals running the kept tokens alone with masks written by hand
    from their original positions: a sliding layer's query at position p sees kept keys at positions
    (p - window, p], a global layer every earlier kept key, and the image's kept tokens see each other.
    Counting the window over kept tokens instead (the stock masks of the short sequence) differs."""
    model = tiny_gemma3()
    batch = gemma3_batch(model, 2)
    window = model.config.text_config.sliding_window
    pruned = _prune_thirds(batch)
    seen = language_model_inputs(model, batch)
    index = _kept_index(pruned)  # [B, K]
    embeds = seen["inputs_embeds"].gather(1, index[..., None].expand(-1, -1, seen["inputs_embeds"].shape[-1]))
    positions = seen["position_ids"]
    if positions is None:  # a plain forward: the text model numbers the prompt 0 .. S-1, padding included
        positions = torch.arange(batch.seq_len)
    positions = positions.expand(2, -1).gather(1, index)  # [B, K] original positions
    valid = batch.attention_mask.gather(1, index).bool()
    image = (batch.input_ids == model.config.image_token_id).gather(1, index)
    q, k = positions[:, :, None], positions[:, None, :]
    causal = (k <= q) | (image[:, :, None] & image[:, None, :])
    allowed = causal & valid[:, None, :]
    masks = {"full_attention": allowed[:, None], "sliding_attention": (allowed & (q - k < window))[:, None]}
    for kind in masks:  # padding queries see themselves (their outputs are never read)
        lone = ~masks[kind].any(-1, keepdim=True)
        masks[kind] = masks[kind] | (lone & torch.eye(index.shape[1], dtype=torch.bool))
    lm = model.model.language_model
    with torch.no_grad():
        by_hand = model.lm_head(lm(inputs_embeds=embeds, position_ids=positions, attention_mask=masks)[0])
        short = model.model(
            inputs_embeds=embeds,
            position_ids=positions,
            attention_mask=valid.long(),
            token_type_ids=image.long(),
        ).last_hidden_state
    ref = _logits(model, batch, [(-1, pruned)]).gather(1, index[..., None].expand(-1, -1, by_hand.shape[-1]))
    torch.testing.assert_close(ref[valid], by_hand[valid], atol=ATOL, rtol=0)
    assert (model.lm_head(short)[valid] - by_hand[valid]).abs().max() > 1e-6, "kept-token windows must differ"


def test_hybrid_prune_after_last_layer_equals_cache_removal():
    """Qwen3.5, L = last layer: a decode step equals decoding from a stock prefill whose full-attention
    caches lost the pruned entries; the linear-attention states keep what they absorbed."""
    model, batch = setup("qwen3.5", 2)
    pruned = _prune_thirds(batch)
    last = len(LAYER_TYPES) - 1
    seen = language_model_inputs(model, batch)
    lm = model.model.language_model
    embeds, positions, mask = seen["inputs_embeds"], seen["position_ids"], batch.attention_mask
    new_positions = positions[..., -1:] + 1
    ones = torch.ones_like(mask[:, :1])
    with torch.no_grad():
        new = lm.embed_tokens(torch.tensor([[7], [8]]))
        cache = lm(inputs_embeds=embeds, position_ids=positions, attention_mask=mask, use_cache=True)[1]
        index = _kept_index(pruned)
        for layer in FULL_ATTENTION_LAYERS:
            entry = cache.layers[layer]
            kv = index[:, None, :, None].expand(-1, entry.keys.shape[1], -1, entry.keys.shape[-1])
            entry.keys, entry.values = entry.keys.gather(2, kv), entry.values.gather(2, kv)
        compact = torch.cat([mask.gather(1, index), ones], 1)
        physical = lm(
            inputs_embeds=new, position_ids=new_positions, attention_mask=compact, past_key_values=cache
        )
        with pruned_reference(model, [(last, pruned)], mask):
            cache = lm(inputs_embeds=embeds, position_ids=positions, attention_mask=mask, use_cache=True)[1]
            full = torch.cat([mask, ones], 1)
            ref = lm(
                inputs_embeds=new, position_ids=new_positions, attention_mask=full, past_key_values=cache
            )
    torch.testing.assert_close(ref.last_hidden_state, physical.last_hidden_state, atol=ATOL, rtol=0)
