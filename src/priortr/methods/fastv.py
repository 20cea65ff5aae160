"""FastV (Chen et al., "An Image is Worth 1/2 Tokens After Layer 2", ECCV 2024).

After one early decoder layer, keep the visual tokens the last prompt token attends to most
(head mean). Authors' code: github.com/pkunlp-icler/FastV. FastV's K = 2 (prune from layer 2 on) is
``layer=1`` here: our ``layer`` is the 0-indexed layer whose attention is scored.
"""

from __future__ import annotations

import torch

from priortr.methods.registry import register_rule
from priortr.scoring import Evidence


@register_rule("fastv", summary="attention of the last prompt token", source="FastV, Chen et al., ECCV 2024")
def fastv_score(evidence: Evidence) -> torch.Tensor:
    """FastV's ranking signal: the last prompt token's head-aggregated attention."""
    return evidence.last
