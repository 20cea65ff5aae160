"""The per-row gather behind every physical prune: the hidden states, RoPE, masks and KV caches of a
batch keep each row's own columns (paper Sec. 3.3, Algorithm 1, Phase 3: kept tokens keep their original
RoPE phases because the (cos, sin) pairs and position ids are gathered, never recomputed)."""

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


def stack_views(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack``, as a free view when there is one tensor."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)
