"""VisPruner (Zhang et al., "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token
Pruning in VLMs", ICCV 2025): important tokens by [CLS] attention, then diverse tokens by removing
duplicates, before the LLM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from priortr.methods.registry import register_method
from priortr.methods.selection import Selection, StageInputs, keep_all
from priortr.methods.tokens import stack_rows
from priortr.methods.validate import check_budget, check_features, check_fraction, check_int, check_vision_cls


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
    """VisPruner on one image: ``features`` [N, C], ``cls_attention`` [N]; returns [K] indices."""
    n_important = int(budget * important_ratio)
    n_diverse = budget - n_important
    order = torch.sort(cls_attention, descending=True, stable=True).indices  # [N]
    important, residual = order[:n_important], order[n_important:]
    if n_diverse == 0:
        return important
    features = F.normalize(features.to(torch.promote_types(features.dtype, torch.float32)), dim=-1)
    diverse = _remove_duplicates(features @ features.T, residual, n_diverse, step)  # [K - n_important]
    return torch.cat([important, diverse])


def _check_knobs(*, important_ratio: float, step: int) -> None:
    check_fraction("vispruner important_ratio", important_ratio)
    check_int("vispruner step", step)


@register_method(
    "vispruner",
    where="vision",
    needs=("vision", "features"),
    summary="important tokens by [CLS] attention plus diverse tokens by de-duplication",
    source="VisPruner, Zhang et al., ICCV 2025",
    check_knobs=_check_knobs,
)
def vispruner(inputs: StageInputs, *, important_ratio: float = 0.5, step: int = 8) -> Selection:
    """VisPruner: important tokens by [CLS] attention, then diverse tokens by removing duplicates.

    Zhang et al., "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token Pruning
    in VLMs", ICCV 2025 (arXiv 2412.01818); authors' code: github.com/Theia-4869/VisPruner at
    aefa01adc7c7ce6334e880c88225e90cede760d1, ``llava/model/llava_arch.py`` (``encode_images``) and
    ``llava/model/multimodal_encoder/clip_encoder.py`` (``feature_select``); defaults in
    ``llava/eval/model_vqa_loader.py`` (``--important_ratio 0.5``). Of the K kept tokens,
    ``int(K * important_ratio)`` are those with the highest head-mean [CLS] attention of the vision
    layer whose output the model uses (``attentions[select_layer]``). The others, in descending
    attention order, are de-duplicated in rounds (ToMe-style bipartite matching): alternate tokens
    form sides A and B, each A token scores its highest cosine similarity to B, and the ``step`` most
    duplicated A tokens are dropped, until K remain in all. Similarity is measured, as the authors
    measure it, on the vision tower's features before the projector (``inputs.vision_features``).

    Deviation: sorts are stable (the authors' ``argsort`` is not), which matters only for exact ties.

    Requires ``inputs.vision_cls`` [B, N] and ``inputs.vision_features`` [B, N, C]. Knobs:
    ``important_ratio`` in [0, 1], ``step`` (int >= 1, tokens dropped per round; the authors' 8).
    """
    budget = check_budget(inputs, "vispruner")
    cls_attention = check_vision_cls(inputs, "vispruner")
    features = check_features(inputs, "vispruner")
    _check_knobs(important_ratio=important_ratio, step=step)
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    rows = [
        _vispruner_row(image_features, attention, budget, important_ratio, step)
        for image_features, attention in zip(features, cls_attention, strict=True)
    ]
    return stack_rows(rows)
