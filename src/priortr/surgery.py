"""Tensor surgery for physical pruning: keep a subset of sequence positions, per batch row.

Every function takes ``index`` [B, S'] (ascending absolute positions to keep, the same count in every
row) and returns tensors of sequence length S'. Kept tokens keep their original RoPE phases because
the (cos, sin) pairs and position ids are gathered, never recomputed (paper Sec. 3.3, Algorithm 1,
Phase 3; renumbering positions is measurably not equivalent).
"""

from __future__ import annotations

import torch


def gather_sequence(x: torch.Tensor, index: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Keep positions ``index`` [B, S'] along ``dim`` of ``x`` (batch first, or broadcast batch 1)."""
    index = index.to(x.device)
    if x.shape[0] == 1 and index.shape[0] > 1:
        x = x.expand(index.shape[0], *x.shape[1:])
    shape = [1] * x.ndim
    shape[0], shape[dim] = index.shape
    full = list(x.shape)
    full[dim] = index.shape[1]
    return x.gather(dim, index.view(shape).expand(full))


def gather_attention_mask(
    mask: torch.Tensor | None, index: torch.Tensor, seq_len: int, static_slots: bool = False
) -> torch.Tensor | None:
    """The mask a decoder layer should see once only ``index`` positions are left.

    ``None`` (implicit causal, SDPA without padding) stays ``None``: kept tokens are in order, so the
    short sequence is still causal. A 2D padding mask (FlashAttention) keeps the indexed columns. A 4D
    mask [B, 1, S, S_kv] keeps the indexed rows and columns. With a static cache (``static_slots``),
    keys always span the S_kv preallocated slots: the prompt's kept columns move to the front, like the
    compacted cache entries, and every other column is masked.
    """
    if mask is None:
        return None
    if mask.ndim == 2:
        return gather_sequence(mask, index, dim=1)
    if mask.ndim != 4:
        raise ValueError(f"unsupported attention mask of shape {tuple(mask.shape)}; expected None, 2D or 4D")
    rows = gather_sequence(mask, index, dim=2)  # [B, 1, S', S_kv]
    kept_cols = gather_sequence(rows[..., :seq_len], index, dim=3)  # [B, 1, S', S']
    if not static_slots:
        return kept_cols
    out = torch.full_like(rows, _masked_value(mask))
    out[..., : index.shape[1]] = kept_cols
    return out


def hide_key_columns(mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``mask`` (2D padding or 4D) with its first key columns masked where ``hidden`` [B, S'] is True.

    Rows of a batch whose visual tokens were pruned to different counts keep some pruned tokens so
    that every row has the same length; those keys (the first S' columns of a gathered layer mask, or
    the cached prompt's columns of a later call's mask) must be invisible to every query.
    """
    blocked = torch.zeros(mask.shape[0], mask.shape[-1], dtype=torch.bool, device=mask.device)
    blocked[:, : hidden.shape[1]] = hidden.to(mask.device)
    if mask.ndim == 2:
        return mask.masked_fill(blocked, 0)
    return mask.masked_fill(blocked[:, None, None, :], _masked_value(mask))


def explicit_causal_mask(hidden: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The mask a layer gets instead of ``None`` (implicit causal) once keys ``hidden`` [B, S] must be
    masked: a 2D padding mask for FlashAttention, else 4D, boolean for SDPA and additive for eager."""
    if "flash" in implementation:
        return (~hidden).long()
    seq = hidden.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=hidden.device).tril()
    allowed = causal[None, None] & ~hidden[:, None, None, :]  # [B, 1, S, S]
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=hidden.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def _masked_value(mask: torch.Tensor) -> bool | float:
    return False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min


def drop_columns(mask_2d: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Drop pruned prompt columns from a 2D padding mask that spans prompt + later tokens.

    Args:
        mask_2d: [B, S_prompt + T] as ``generate()`` keeps it, in original positions.
        keep: [B, S_prompt] bool, True where the prompt token is still in the cache.
    """
    batch, prompt = keep.shape
    kept = mask_2d[:, :prompt][keep.to(mask_2d.device)].view(batch, -1)
    return torch.cat([kept, mask_2d[:, prompt:]], dim=1)


def compact_cache_layer(layer: object, index: torch.Tensor, seq_len: int, static: bool) -> None:
    """Keep ``index`` positions of one cache layer's keys and values, in place.

    Dynamic layers get new, shorter tensors. Static layers keep their preallocated storage (and its
    static address for CUDA graphs): kept entries move to the front, the rest is zeroed, and the
    filled length drops to S'.
    """
    if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
        raise ValueError("cannot prune an empty cache layer; pruning happens during the prefill")
    if static:
        kept = index.shape[1]
        for name in ("keys", "values"):
            store = getattr(layer, name)
            moved = gather_sequence(store[:, :, :seq_len], index, dim=2)
            store[:, :, :kept].copy_(moved)
            store[:, :, kept:seq_len].zero_()
        layer.cumulative_length.fill_(kept)
        return
    layer.keys = gather_sequence(layer.keys, index, dim=2)
    layer.values = gather_sequence(layer.values, index, dim=2)
