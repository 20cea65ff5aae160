"""Small helpers over one image's visual tokens, shared by the selectors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from priortr.methods.selection import Selection


def unit(features: torch.Tensor) -> torch.Tensor:
    """Rows of ``features`` [N, D] scaled to unit L2 norm in float32, so dot products are cosines."""
    return F.normalize(features.float(), dim=-1)


def descending(scores: torch.Tensor) -> torch.Tensor:
    """Indices of ``scores`` [N] from highest to lowest; equal scores keep the lower index first."""
    return torch.sort(scores, descending=True, stable=True).indices


def untaken(taken: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` indices where ``taken`` [N] is False, ascending (``(~taken).nonzero()`` when
    ``count`` is the number of them): a stable sort puts them first, so the shape is known on the host
    and nothing is read back (a compiled stage stays in one graph)."""
    return torch.sort(taken.to(torch.uint8), stable=True).indices[:count]


def stack_rows(rows: list[torch.Tensor]) -> Selection:
    """Stack per-image index sets [K] into a Selection with ascending rows [B, K]."""
    return Selection(indices=torch.stack([row.sort().values for row in rows]))
