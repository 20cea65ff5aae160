"""VisPruner (Zhang et al., "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token
Pruning in VLMs", ICCV 2025): important tokens by [CLS] attention, then diverse tokens by removing
duplicates, before the LLM.
"""

from __future__ import annotations

import torch

from priortr.methods.checks import check_budget, check_fraction, check_int, check_vision_cls
from priortr.methods.registry import register_method
from priortr.methods.tokens import stack_rows, unit
from priortr.selection import Selection, StageInputs, keep_all


def _remove_duplicates(
    similarity: torch.Tensor, residual: torch.Tensor, target: int, step: int
) -> torch.Tensor:
    """Shrink ``residual`` [R] to ``target`` indices by repeated bipartite de-duplication.

    Each round splits the residual into alternate halves A (even positions) and B (odd positions),
    scores every A token by its highest cosine similarity to a B token, and drops the ``step`` (at
    most) highest-scoring A tokens; the survivors of A, most duplicated first, precede B next round.
    ``similarity`` [N, N] holds the cosines of all token pairs, computed once for every round.
    """
    while residual.numel() > target:
        drop = min(step, residual.numel() - target)
        side_a, side_b = residual[0::2], residual[1::2]  # [ceil(R/2)], [floor(R/2)]
        pairs = similarity.index_select(0, side_a).index_select(1, side_b)  # [ceil(R/2), floor(R/2)]
        duplication = pairs.amax(dim=-1)  # [ceil(R/2)]
        survivors = torch.sort(duplication, descending=True, stable=True).indices[drop:]
        residual = torch.cat([side_a[survivors], side_b])
    return residual


def _vispruner_row(
    features: torch.Tensor, cls_attention: torch.Tensor, budget: int, important_ratio: float, step: int
) -> torch.Tensor:
    """VisPruner on one image: ``features`` [N, D], ``cls_attention`` [N]; returns [K] indices."""
    n_important = int(budget * important_ratio)
    n_diverse = budget - n_important
    order = torch.sort(cls_attention.float(), descending=True, stable=True).indices  # [N]
    important, residual = order[:n_important], order[n_important:]
    if n_diverse == 0:
        return important
    features = unit(features)  # [N, D]
    diverse = _remove_duplicates(features @ features.T, residual, n_diverse, step)  # [K - n_important]
    return torch.cat([important, diverse])


@register_method(
    "vispruner",
    where="vision",
    needs=("vision",),
    summary="important tokens by [CLS] attention plus diverse tokens by de-duplication",
    source="VisPruner, Zhang et al., ICCV 2025",
)
def vispruner(inputs: StageInputs, *, important_ratio: float = 0.5, step: int = 8) -> Selection:
    """VisPruner: important tokens by [CLS] attention, then diverse tokens by removing duplicates.

    Zhang et al., "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token Pruning
    in VLMs", ICCV 2025 (arXiv 2412.01818); authors' code: github.com/Theia-4869/VisPruner,
    ``llava/model/llava_arch.py`` (``encode_images``), defaults in ``llava/eval/model_vqa_loader.py``
    (``--important_ratio 0.5``). Of the K kept tokens, ``int(K * important_ratio)`` are those with
    the highest head-mean [CLS] attention of the vision layer whose output the model uses. The
    others, in descending attention order, are de-duplicated in rounds (ToMe-style bipartite
    matching): alternate tokens form sides A and B, each A token scores its highest cosine
    similarity to B, and the ``step`` most duplicated A tokens are dropped, until K remain in all.

    Deviation: the authors compare the vision tower's output features before the projector; a
    selector sees ``inputs.hidden``, the projector's output (the LLM input embeddings) of those same
    features: exact duplicates stay duplicates, near-duplicates are judged through the projector.

    Requires ``inputs.vision_cls`` [B, N] and ``inputs.hidden`` [B, N, D]. Knobs:
    ``important_ratio`` in [0, 1], ``step`` (int >= 1, tokens dropped per round).
    """
    budget = check_budget(inputs, "vispruner")
    cls_attention = check_vision_cls(inputs, "vispruner")
    important_ratio = check_fraction("vispruner important_ratio", important_ratio)
    step = check_int("vispruner step", step)
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    rows = [
        _vispruner_row(features, attention, budget, important_ratio, step)
        for features, attention in zip(inputs.hidden, cls_attention, strict=True)
    ]
    return stack_rows(rows)
