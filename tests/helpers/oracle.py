"""Masked reference ("oracle") for physical visual-token pruning, independent of ``priortr``.

Physical pruning at decoder layer ``L`` runs layers ``0..L`` on every token, then drops the pruned
tokens: layers ``> L`` only ever see the kept tokens, and the pruned tokens' keys/values are also
removed from the cache of layers ``0..L``, so generated tokens never attend to them in any layer.
Kept tokens keep their original RoPE positions.

The oracle reproduces exactly this without removing anything. It keeps the full sequence and, via
forward pre-hooks on the language model's decoder layers, replaces each layer's attention mask by
an explicit additive mask that hides the pruned *key columns*

* from prompt queries in layers ``> L`` (prefill), and
* from generated queries (positions ``>= S_prompt``) in every layer (decode).

Why that is equivalent on every kept position: attention is the only operation that mixes
positions (norms, MLPs and RoPE act per position, and RoPE uses each token's unchanged position
id), and softmax over a set of columns with some columns at ``-inf`` equals softmax over the
remaining columns. Hence, for every kept/text query, each layer's output is the same function of
the same kept inputs as in the physically pruned model, by induction over layers. The pruned
positions still compute (meaningless) hidden states after ``L``, but nobody reads them. Up to the
summation order of floating point, the logits of kept positions and the greedy tokens agree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

KEPT = 1 << 30
"""``last_seen`` of a column that is never pruned."""


def _oracle_mask(
    last_seen: torch.LongTensor,
    valid: torch.BoolTensor,
    layer_idx: int,
    past: int,
    q_len: int,
    kv_len: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive float mask [B, 1, q_len, kv_len] for one decoder layer call.

    ``last_seen``/``valid`` are [B, S_prompt]: the last decoder layer whose prompt queries see each
    prompt column (``KEPT`` if never pruned), and valid = not padding. Queries sit at absolute
    positions ``past .. past + q_len - 1``; key column ``j`` is absolute position ``j``.
    """
    pruned = last_seen < KEPT
    batch, s_prompt = pruned.shape
    device = pruned.device
    q_pos = torch.arange(past, past + q_len, device=device)[:, None]  # [q, 1]
    k_pos = torch.arange(kv_len, device=device)[None, :]  # [1, kv]

    # Prompt columns carry padding / pruning flags; columns after the prompt are generated tokens.
    pad_cols = torch.ones(batch, kv_len, dtype=torch.bool, device=device)  # [B, kv]
    hidden_cols = torch.zeros(batch, kv_len, dtype=torch.bool, device=device)  # [B, kv] from prompt rows
    pruned_cols = torch.zeros(batch, kv_len, dtype=torch.bool, device=device)  # [B, kv]
    n = min(s_prompt, kv_len)
    pad_cols[:, :n] = valid[:, :n]
    hidden_cols[:, :n] = layer_idx > last_seen[:, :n]
    pruned_cols[:, :n] = pruned[:, :n]

    # A pruned key is hidden from prompt queries in the layers after its stage's layer, and from
    # generated queries in every layer.
    is_generated = (q_pos >= s_prompt)[None]  # [1, q, 1]
    hide = torch.where(is_generated, pruned_cols[:, None, :], hidden_cols[:, None, :])  # [B, q, kv]
    allowed = (k_pos <= q_pos)[None] & pad_cols[:, None, :]  # [B, q, kv]; static cache: j > q_pos hidden
    allowed &= ~hide

    # Rows with nothing to attend to (padding queries) would give NaN (softmax of all -inf, e.g.
    # eager attention casts a float64 mask to float32). Let them attend to themselves: their output
    # is only ever read by columns that are masked for every real query, so nothing observable changes.
    empty = ~allowed.any(-1, keepdim=True)  # [B, q, 1]
    allowed |= empty & (k_pos == q_pos)[None]

    mask = torch.zeros(batch, 1, q_len, kv_len, dtype=dtype, device=device)
    return mask.masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def masked_reference(
    model: nn.Module,
    layer: int,
    pruned: torch.BoolTensor,
    attention_mask_2d: torch.Tensor | None = None,
):
    """Make ``model`` behave as if the ``pruned`` prompt tokens were physically removed after ``layer``.

    Args:
        model: an HF multimodal model whose decoder layers are ``model.model.language_model.layers``
            (``model.model.text_model.layers`` for Idefics3 / SmolVLM).
        layer: ``L``, the last decoder layer (0-indexed) that still sees every token; ``-1`` hides
            the pruned tokens from every layer, ``n_layers - 1`` only from generated tokens.
        pruned: [B, S_prompt] bool, True on prompt columns (absolute positions in the left-padded
            prompt) whose keys must be hidden. All-False gives back the stock model.
        attention_mask_2d: [B, S_prompt] prompt padding mask (1 = real token); None = no padding.

    Works for a plain forward on the prompt and for ``generate()`` with a dynamic or static cache,
    with eager or sdpa attention: the mask is rebuilt from the cache length at every layer call, so
    nothing is carried between calls. Hooks are removed on exit.
    """
    return staged_reference(model, [(layer, pruned)], attention_mask_2d)


@contextmanager
def staged_reference(
    model: nn.Module,
    stages: Sequence[tuple[int, torch.BoolTensor]],
    attention_mask_2d: torch.Tensor | None = None,
) -> Iterator[None]:
    """``masked_reference`` for pruning in stages: each (L, pruned) hides its ``pruned`` columns from
    prompt queries of layers after L (L = -1: from every layer), and from every generated query."""
    inner = model.model
    layers = (inner.language_model if hasattr(inner, "language_model") else inner.text_model).layers
    first = stages[0][1]
    last_seen = torch.full(first.shape, KEPT, dtype=torch.long)
    for layer, pruned in stages:
        assert pruned.shape == first.shape, (pruned.shape, first.shape)
        last_seen = torch.where(pruned.cpu() & (last_seen == KEPT), layer, last_seen)
    if attention_mask_2d is None:
        attention_mask_2d = torch.ones_like(first, dtype=torch.long)
    assert first.shape == attention_mask_2d.shape, (first.shape, attention_mask_2d.shape)

    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], layer_idx: int
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        hidden = args[0] if args else kwargs["hidden_states"]  # [B, q_len, D]
        q_len = hidden.shape[1]
        cache = kwargs.get("past_key_values")
        if cache is None:
            past, kv_len = 0, q_len
        else:  # before this layer's cache update: `past` cached tokens, keys padded to kv_len (static)
            past = int(cache.get_seq_length(layer_idx))
            kv_len = int(cache.get_mask_sizes(q_len, layer_idx)[0])
        device = hidden.device
        kwargs["attention_mask"] = _oracle_mask(
            last_seen.to(device),
            attention_mask_2d.to(device).bool(),
            layer_idx,
            past,
            q_len,
            kv_len,
            hidden.dtype,
        )
        return args, kwargs

    handles = [
        mod.register_forward_pre_hook(partial(hook, layer_idx=i), with_kwargs=True)
        for i, mod in enumerate(layers)
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
