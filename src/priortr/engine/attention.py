"""Attention rows at the scoring layer, recomputed from the layer's own projections.

PriorTR needs, at decoder layer L, the attention of a handful of rows (the separator row for the prior
Q and the instruction rows for the posterior P, paper Appendix A.3) over the visual tokens. Fused
attention kernels (SDPA, FlashAttention) never materialise attention weights, and forcing eager
attention would slow the whole prefill down. Instead the query rows and all keys that the layer
already projected are captured, RoPE is applied to them as the layer does, and only the needed rows
of softmax(q k^T) are computed, with the causal and padding masks applied explicitly: transformers
passes ``attention_mask=None`` under SDPA when nothing is padded, so a mask read from the layer's
arguments would let the separator row see the instruction (the defect of the authors' Qwen code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowSpec:
    """Which rows to recompute and which keys each row may see.

    ``rows`` [B, R] are the current sequence columns of the recomputed rows (each batch row picks its
    own; padding entries are masked later by whoever reads them); a row sees keys at columns up to its
    own, where ``key_valid`` [B, S] is True (False on padding and on pruned tokens kept only to make
    ragged rows the same length). At a layer with local attention, ``window(query, key)`` says which
    keys are in a row's window, given the prompt positions ``positions`` [B, S] of the columns.
    """

    rows: torch.Tensor
    key_valid: torch.Tensor
    window: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    positions: torch.Tensor | None = None


def attention_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    spec: RowSpec,
    scaling: float,
) -> torch.Tensor:
    """Softmax attention of the ``spec.rows`` query rows over all S keys, in at least float32.

    Args:
        queries: [B, H, R, d] post-RoPE queries of the rows ``spec.rows``.
        keys: [B, H_kv, S, d] post-RoPE keys; grouped-query heads are shared by ``H // H_kv`` queries.
        spec: the rows' columns and the keys' validity.
        scaling: the layer's softmax scale (``head_dim ** -0.5`` for LLaMA and Qwen).

    Returns:
        [B, H, R, S] attention probabilities (float32, or float64 for a float64 model), with the
        causal mask (a row sees keys at or before its column) and ``key_valid`` applied before the
        softmax.
    """
    batch, heads, rows, dim = queries.shape
    kv_heads, seq = keys.shape[1], keys.shape[2]
    dtype = torch.promote_types(queries.dtype, torch.float32)
    q = queries.to(dtype).view(batch, kv_heads, heads // kv_heads, rows, dim)  # [B, Hkv, G, R, d]
    k = keys.to(dtype).unsqueeze(2)  # [B, Hkv, 1, S, d]
    logits = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, Hkv, G, R, S]
    logits = logits.view(batch, heads, rows, seq)

    row_pos = spec.rows.to(keys.device)[:, :, None]  # [B, R, 1]
    key_pos = torch.arange(seq, device=keys.device)  # [S]
    visible = (key_pos <= row_pos) & spec.key_valid[:, None, :].to(keys.device)  # [B, R, S]
    if spec.window is not None:
        positions = spec.positions.to(keys.device)  # [B, S]
        row_positions = positions.gather(1, spec.rows.to(keys.device))  # [B, R]
        visible &= spec.window(row_positions[:, :, None], positions[:, None, :])
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    # A padded row sees no key at all; its probabilities are zero instead of NaN and are ignored later.
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def cls_attention(
    query_out: torch.Tensor, key_out: torch.Tensor, heads: int, scaling: float, first_token: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision tower's [CLS] attention over its tokens, and their keys, from the q/k projections.

    ViT attention has no mask; the [CLS] token is token 0. Returns the head-mean [CLS] row over tokens
    ``first_token ..`` [B, N] (float32, or float64 for a float64 tower; softmax over every token as the
    tower computes it) and the keys of those tokens [B, H, N, d], as VisionZip and VisPruner read them
    (Yang et al., CVPR 2025; Zhang et al., ICCV 2025).
    """
    batch, tokens, width = key_out.shape
    dtype = torch.promote_types(key_out.dtype, torch.float32)
    keys = key_out.to(dtype).view(batch, tokens, heads, width // heads).transpose(1, 2)  # [B, H, T, d]
    cls = query_out[:, :1].to(dtype).view(batch, 1, heads, width // heads).transpose(1, 2)  # [B, H, 1, d]
    row = torch.softmax(torch.matmul(cls, keys.transpose(-1, -2)) * scaling, dim=-1)  # [B, H, 1, T]
    return row[:, :, 0, first_token:].mean(dim=1), keys[:, :, first_token:]


def cls_attention_concatenated(
    query_out: torch.Tensor, key_out: torch.Tensor, width: int, first_token: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PruMerge's [CLS] attention: one softmax of the [CLS] query against every key, all heads
    concatenated, scaled by ``width ** -0.5``; and the keys, heads concatenated.

    The authors (github.com/42Shawn/LLaVA-PruMerge, ``clip_encoder.py``, ``token_prune_merge_advanced``)
    hook the q/k projections of the tower's last layer and compute ``softmax(q @ k^T * C ** -0.5)`` on
    the full projections, not per head. Returns the [CLS] row over tokens ``first_token ..`` [B, N]
    (float32 or float64, softmax over every token) and those tokens' keys [B, N, C].
    """
    dtype = torch.promote_types(key_out.dtype, torch.float32)
    keys = key_out.to(dtype)  # [B, T, C]
    cls = query_out[:, :1].to(dtype)  # [B, 1, C]
    row = torch.softmax(torch.matmul(cls, keys.transpose(-1, -2)) * width**-0.5, dim=-1)  # [B, 1, T]
    return row[:, 0, first_token:], keys[:, first_token:]
