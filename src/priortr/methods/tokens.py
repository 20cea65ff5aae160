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


def stack_rows(rows: list[torch.Tensor]) -> Selection:
    """Stack per-image index sets [K] into a Selection with ascending rows [B, K]."""
    return Selection(indices=torch.stack([row.sort().values for row in rows]))
