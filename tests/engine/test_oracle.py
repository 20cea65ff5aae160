"""Tests of the masked reference (``tests/helpers/oracle.py``) itself, before anything is compared to it.

The oracle must (a) be the stock model when nothing is pruned, (b) actually change the output
when something is, (c) leave untouched what physical pruning cannot reach, and (d) equal physical
removal of the pruned tokens in the two cases that are easy to build by hand: pruning before layer
0 (rerun the language model on the kept embeddings with their original position ids) and pruning
after the last layer (drop the pruned entries from a stock prefill's KV cache, then decode).
All comparisons run in float64. The oracle runs without a cache and refuses to continue one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from tests.helpers.oracle import masked_reference
from tests.helpers.tiny import (
    Batch,
    language_model_inputs,
    llava_batch,
    qwen_batch,
    tiny_llava,
    tiny_qwen2_5_vl,
)

ATOL = 1e-10
BUILDERS: dict[str, tuple[Callable[..., PreTrainedModel], Callable[..., Batch]]] = {
    "llava": (tiny_llava, llava_batch),
    "qwen2_5_vl": (tiny_qwen2_5_vl, lambda m, **kw: qwen_batch(m, grid=(1, 8, 8), **kw)),  # 16 visual
}
MODELS = list(BUILDERS)


@cache
def _model(name: str, attn: str = "sdpa") -> PreTrainedModel:
    """Build each tiny model once per session (they are never modified by the tests)."""
    return BUILDERS[name][0](attn=attn)


def _setup(name: str, batch_size: int, attn: str = "sdpa") -> tuple[PreTrainedModel, Batch]:
    model = _model(name, attn)
    return model, BUILDERS[name][1](model, batch_size=batch_size)


def _prune_odd(batch: Batch) -> torch.BoolTensor:
    """[B, S] True on every second visual token (same count per row, so kept rows stay rectangular)."""
    pruned = batch.visual_mask()
    for r, start in enumerate(batch.image_start):
        pruned[r, start : batch.image_end[r] : 2] = False
    return pruned


def _n_layers(model: PreTrainedModel) -> int:
    return len(model.model.language_model.layers)


def _logits(
    model: PreTrainedModel, batch: Batch, layer: int | None = None, pruned: Any = None
) -> torch.Tensor:
    """Prefill logits [B, S, V], stock (``layer is None``) or under the oracle."""
    with torch.no_grad():
        if layer is None:
            return model(**batch.kwargs()).logits
        with masked_reference(model, layer, pruned, batch.attention_mask):
            return model(**batch.kwargs()).logits


def _generate(model: PreTrainedModel, batch: Batch, cache_impl: str | None, **oracle: Any) -> Any:
    """Greedy 4-token ``generate`` with per-step logits, optionally under the oracle."""
    kwargs = {"max_new_tokens": 4, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    if cache_impl is not None:
        kwargs["cache_implementation"] = cache_impl
    if not oracle:
        return model.generate(**batch.kwargs(), **kwargs)
    with masked_reference(model, attention_mask_2d=batch.attention_mask, **oracle):
        return model.generate(**batch.kwargs(), **kwargs)


# (a) Nothing pruned -> stock model, for forward and generate, padded or not, dynamic or static cache.
@pytest.mark.parametrize("cache_impl", [None, "static"])
@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("name", MODELS)
def test_nothing_pruned_is_stock(name: str, batch_size: int, cache_impl: str | None) -> None:
    model, batch = _setup(name, batch_size)
    none = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    valid = batch.attention_mask.bool()  # padding rows' outputs are irrelevant
    if cache_impl is None:
        torch.testing.assert_close(
            _logits(model, batch, 1, none)[valid], _logits(model, batch)[valid], atol=ATOL, rtol=0
        )

    stock = _generate(model, batch, cache_impl)
    ref = _generate(model, batch, cache_impl, layer=1, pruned=none)
    assert torch.equal(ref.sequences, stock.sequences)
    torch.testing.assert_close(torch.stack(ref.logits), torch.stack(stock.logits), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_nothing_pruned_is_stock_eager(name: str) -> None:
    """Same with eager attention (batch 1: stock eager float64 NaNs on padded rows, see below)."""
    model, batch = _setup(name, 1, attn="eager")
    none = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    torch.testing.assert_close(_logits(model, batch, 1, none), _logits(model, batch), atol=ATOL, rtol=0)


# (b) Pruning visual tokens changes the text that follows them, in prefill and in decode.
@pytest.mark.parametrize("name", MODELS)
def test_pruning_changes_output(name: str) -> None:
    model, batch = _setup(name, 2)
    pruned = _prune_odd(batch)
    stock, ref = _logits(model, batch), _logits(model, batch, 1, pruned)
    assert (ref[:, -1] - stock[:, -1]).abs().amax(-1).min() > 1e-6  # every row's last position

    # Pruning after the last layer leaves the prefill alone but decode still loses the columns.
    last = _n_layers(model) - 1
    gen_stock = _generate(model, batch, None)
    gen_ref = _generate(model, batch, None, layer=last, pruned=pruned)
    torch.testing.assert_close(gen_ref.logits[0], gen_stock.logits[0], atol=ATOL, rtol=0)
    assert (gen_ref.logits[1] - gen_stock.logits[1]).abs().amax(-1).min() > 1e-6


# (c) What physical pruning cannot reach stays bit-for-bit stock.
@pytest.mark.parametrize("name", MODELS)
def test_untouched_positions(name: str) -> None:
    model, batch = _setup(name, 2)
    pruned = _prune_odd(batch)
    stock, valid = _logits(model, batch), batch.attention_mask.bool()
    # Positions before the first pruned column never attend to it (causality), whatever L is.
    first = pruned.float().argmax(-1)  # [B]
    before = valid & (torch.arange(batch.seq_len)[None] < first[:, None])
    torch.testing.assert_close(_logits(model, batch, 0, pruned)[before], stock[before], atol=ATOL, rtol=0)
    # L = last layer: the prefill is the stock prefill at every position.
    last = _n_layers(model) - 1
    torch.testing.assert_close(_logits(model, batch, last, pruned)[valid], stock[valid], atol=ATOL, rtol=0)


# (d) Equality with physically removing the pruned tokens.
def _lm_inputs(model: PreTrainedModel, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged ``inputs_embeds`` [B, S, D] and position ids ([B, S] or Qwen's [3, B, S]) that the
    stock model feeds its language model for ``batch``."""
    seen = language_model_inputs(model, batch)
    pos = seen["position_ids"]
    if pos is None:  # LLaVA's plain forward: the text model uses arange(S), padding included
        pos = torch.arange(batch.seq_len).expand(batch.batch_size, -1)
    return seen["inputs_embeds"], pos


def _kept_index(pruned: torch.BoolTensor) -> torch.LongTensor:
    """[B, K] column indices of the kept (not pruned) positions, in order."""
    batch, seq = pruned.shape
    return torch.arange(seq).expand(batch, -1)[~pruned].view(batch, -1)


def _gather_pos(pos: torch.Tensor, idx: torch.LongTensor) -> torch.Tensor:
    """Gather the last axis of [B, S] or [3, B, S] position ids at idx [B, K]."""
    return pos.gather(-1, idx.expand(*pos.shape[:-1], idx.shape[-1]))


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("name", MODELS)
def test_prune_before_layer0_equals_removal(name: str, batch_size: int) -> None:
    """L = -1 hides the pruned columns in every layer: the same as never feeding those tokens."""
    model, batch = _setup(name, batch_size)
    pruned = _prune_odd(batch)
    emb, pos = _lm_inputs(model, batch)
    idx = _kept_index(pruned)  # [B, K]
    mask_k = batch.attention_mask.gather(1, idx)  # [B, K]
    with torch.no_grad():
        hidden = model.model.language_model(
            inputs_embeds=emb.gather(1, idx[..., None].expand(-1, -1, emb.shape[-1])),
            position_ids=_gather_pos(pos, idx),
            attention_mask=mask_k,
        ).last_hidden_state
        removed = model.lm_head(hidden)  # [B, K, V]
    ref = _logits(model, batch, -1, pruned).gather(1, idx[..., None].expand(-1, -1, removed.shape[-1]))
    valid = mask_k.bool()
    torch.testing.assert_close(ref[valid], removed[valid], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_prune_after_last_layer_equals_cache_removal(name: str) -> None:
    """L = last layer: a decode step must equal decoding from a stock prefill cache with the
    pruned entries gathered out of every layer. The oracle runs the whole sequence (prompt + the new
    token) without a cache."""
    model, batch = _setup(name, 2)
    pruned = _prune_odd(batch)
    lm, last = model.model.language_model, _n_layers(model) - 1
    emb, pos = _lm_inputs(model, batch)
    mask = batch.attention_mask  # [B, S]
    new_pos = pos[..., -1:] + 1  # RoPE position of one new token per row, after the prompt
    ones = torch.ones_like(mask[:, :1])

    with torch.no_grad():
        new_emb = lm.embed_tokens(torch.tensor([[7], [8]]))  # [B, 1, D]
        # Physical: stock prefill, drop the pruned entries from every layer's cache, decode.
        cache = lm(inputs_embeds=emb, position_ids=pos, attention_mask=mask, use_cache=True).past_key_values
        idx = _kept_index(pruned)
        for layer in cache.layers:
            kv_idx = idx[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, kv_idx), layer.values.gather(2, kv_idx)
        mask_k = torch.cat([mask.gather(1, idx), ones], 1)
        physical = lm(
            inputs_embeds=new_emb, position_ids=new_pos, attention_mask=mask_k, past_key_values=cache
        )

        # Oracle: keep everything, mask the pruned columns.
        with masked_reference(model, last, pruned, mask):
            ref = lm(
                inputs_embeds=torch.cat([emb, new_emb], 1),
                position_ids=torch.cat([pos, new_pos], -1),
                attention_mask=torch.cat([mask, ones], 1),
                use_cache=False,
            )
    torch.testing.assert_close(ref.last_hidden_state[:, -1:], physical.last_hidden_state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", MODELS)
def test_the_oracle_refuses_to_continue_a_cache(name: str) -> None:
    """The reference sees every call whole; a decode step on a cache would misplace its queries."""
    model, batch = _setup(name, 1)
    with (
        masked_reference(model, 1, _prune_odd(batch), batch.attention_mask),
        torch.no_grad(),
        pytest.raises(RuntimeError, match="whole sequence"),
    ):
        model.generate(**batch.kwargs(), max_new_tokens=2, do_sample=False, use_cache=True)


# (e) the oracle's attention replaces the model's own, whichever it is, and hands it back.
@pytest.mark.parametrize("name", MODELS)
def test_the_oracle_is_the_same_for_eager_and_sdpa_models(name: str) -> None:
    """With left padding and pruning, the oracle of an eager model is finite and equals the oracle of the
    same weights under SDPA (to 1e-6: the softmax is taken in float32, as eager attention takes it); each
    model gets its own attention implementation back afterwards."""
    (model_e, batch), model_s = _setup(name, 2, attn="eager"), _model(name, "sdpa")
    pruned = _prune_odd(batch)
    eager, sdpa = _logits(model_e, batch, 1, pruned), _logits(model_s, batch, 1, pruned)
    valid = batch.attention_mask.bool()
    assert torch.isfinite(eager[valid]).all()
    torch.testing.assert_close(eager[valid], sdpa[valid], atol=1e-6, rtol=0)  # eager: float32 softmax
    gen_e = _generate(model_e, batch, "static", layer=1, pruned=pruned)
    gen_s = _generate(model_s, batch, "static", layer=1, pruned=pruned)
    assert torch.equal(gen_e.sequences, gen_s.sequences)
    assert model_e.config.get_text_config()._attn_implementation == "eager"
    assert model_s.config.get_text_config()._attn_implementation == "sdpa"
