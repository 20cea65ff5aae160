"""FastV (Chen et al., "An Image is Worth 1/2 Tokens After Layer 2", ECCV 2024).

After one early decoder layer, keep the visual tokens the last prompt token attends to most
(head mean). Authors' code: github.com/pkunlp-icler/FastV at d1659729,
``src/FastV/llava-hf/transformers/src/transformers/models/llama/modeling_llama.py``: the attention
weights of layer ``FASTV_k - 1``, ``torch.mean(..., dim=1)[0][-1]`` over the image tokens,
``topk(round(N * (1 - FASTV_r)))``. The paper's K = 2 (prune from layer 2 on) is the default
``layer=1`` here: our ``layer`` is the 0-indexed layer whose attention is scored. The authors' R is the
dropped share: ``budget=1 - R``.
"""

from __future__ import annotations

import torch

from priortr.methods.registry import register_rule
from priortr.methods.scoring import Evidence


@register_rule(
    "fastv", summary="attention of the last prompt token", source="FastV, Chen et al., ECCV 2024", layer=1
)
def fastv_score(evidence: Evidence) -> torch.Tensor:
    """FastV's ranking signal: the last prompt token's head-aggregated attention."""
    return evidence.last
