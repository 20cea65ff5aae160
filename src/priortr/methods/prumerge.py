"""LLaVA-PruMerge and PruMerge+ (Shang et al., "LLaVA-PruMerge: Adaptive Token Reduction for Efficient
Large Multimodal Models", ICCV 2025): tokens kept by the vision tower's [CLS] attention, each absorbing
its key-nearest tokens, before the LLM.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F

from priortr.methods.registry import register_method
from priortr.methods.selection import Selection, StageInputs, keep_all
from priortr.methods.tokens import descending, untaken
from priortr.methods.validate import (
    check_bool,
    check_budget,
    check_features,
    check_int,
    check_vision_last,
    same_count,
)


def iqr_outliers(cls: torch.Tensor) -> int:
    """How many values of ``cls`` [N] lie above Q3 + 1.5 IQR, in float32 as the authors compute it
    (``outlier_dectection``: ``np.percentile`` quartiles, linear interpolation)."""
    values = cls.float()
    q1, q3 = torch.quantile(values, torch.tensor([0.25, 0.75], device=cls.device))
    return int((values > q3 + 1.5 * (q3 - q1)).sum())


def _selection(cls: torch.Tensor, budget: int, adaptive: bool, plus: bool) -> torch.Tensor:
    """The tokens PruMerge(+) keeps for one image, from the [CLS] attention ``cls`` [N]."""
    n_visual = cls.numel()
    order = descending(cls)  # [N]
    taken = torch.zeros(n_visual, dtype=torch.bool, device=cls.device)  # [N]
    if adaptive:
        ratio = max(1, iqr_outliers(cls)) / n_visual  # the authors' reduction_ratio
        top = order[: int(n_visual * ratio)]
        if not plus:
            return top
        stride = max(1, int(int(1 / ratio) / 3))  # the authors' int(step_length / 3)
        grid = torch.arange(0, n_visual - 1, stride, device=cls.device)  # their arange(0, 575, ...) for 576
        taken[top] = True
        return torch.cat([top, grid[~taken[grid]]])
    if not plus:
        return order[:budget]
    n_top = math.ceil(budget / 4)
    taken[order[:n_top]] = True
    rest = untaken(taken, n_visual - n_top)  # [N - n_top] ascending
    picks = ((torch.arange(budget - n_top, device=cls.device) + 0.5) * rest.numel() / (budget - n_top)).long()
    return torch.cat([order[:n_top], rest[picks]])


def _merge_rows(cls: torch.Tensor, keys: torch.Tensor, kept: torch.Tensor, neighbours: int) -> torch.Tensor:
    """Merge rows [K, N]: kept token i with weight 1, and the ``neighbours`` other tokens (kept or not)
    whose keys are most cosine-similar to its own, each with its [CLS] attention as weight."""
    n_visual = cls.numel()
    metric = F.normalize(keys, p=2, dim=-1)  # [N, C]
    similarity = metric[kept] @ metric.T  # [K, N]
    rows = torch.arange(kept.numel(), device=cls.device)
    similarity[rows, kept] = float("-inf")
    near = torch.topk(similarity, min(neighbours, n_visual - 1), dim=-1).indices  # [K, neighbours]
    merge = torch.zeros(kept.numel(), n_visual, dtype=keys.dtype, device=cls.device)
    merge[rows[:, None], near] = cls.to(keys.dtype)[near]
    merge[rows, kept] = 1.0
    return merge


def _check_knobs(*, adaptive: bool, plus: bool, neighbours: int) -> None:
    check_bool("prumerge adaptive", adaptive)
    check_bool("prumerge plus", plus)
    check_int("prumerge neighbours", neighbours, 1)


@register_method(
    "prumerge",
    where="vision",
    needs=("vision_last", "features"),
    summary="[CLS]-attention selection, each kept token absorbing its nearest neighbours",
    source="LLaVA-PruMerge, Shang et al., ICCV 2025",
    check_knobs=_check_knobs,
)
def prumerge(
    inputs: StageInputs, *, adaptive: bool = False, plus: bool = False, neighbours: int = 32
) -> Selection:
    """LLaVA-PruMerge(+): keep tokens by the tower's [CLS] attention, each absorbing its key-nearest tokens.

    Shang et al., ICCV 2025 (arXiv 2403.15388); authors' code: github.com/42Shawn/LLaVA-PruMerge at
    097c04116a58465e4bcb58cec44a94018a68ff1a, ``llava/model/multimodal_encoder/clip_encoder.py``
    (``token_prune_merge_advanced`` = PruMerge, ``token_prune_merge_advanced_plus`` = PruMerge+,
    ``outlier_dectection``). Evidence as the authors hook it: the [CLS] row of one softmax of
    ``q @ k^T * C ** -0.5`` over the q/k projections of the tower's *last* layer, all heads concatenated
    (``inputs.vision_cls_last``), that layer's keys (``inputs.vision_keys_last``), and the features of
    the layer the model uses, before the projector (``inputs.vision_features``).

    Selection: with ``adaptive=False`` (default: the authors' ``if_adaptive=False`` at
    ``reduction_ratio = K / N``, so the budget holds) the top K by that attention; with
    ``adaptive=True`` (the authors' inference default) the IQR outliers, above Q3 + 1.5 IQR (at least
    one), whatever the budget; with ``plus=True`` also (PruMerge+) the authors' spatial grid
    ``arange(0, N - 1, int(int(1 / ratio) / 3))`` (their ``arange(0, 575, ...)`` for 576 tokens) minus
    the tokens already kept. ``plus=True`` with a fixed K has no authors' counterpart (their
    non-adaptive PruMerge+ branch is for training): ceil(K / 4) by attention and the rest of K evenly
    spaced, in sequence order, over the other tokens.

    Merge, as the authors': every kept token i becomes ``x_i + sum_j a_j x_j`` over the ``neighbours``
    (their 32) other tokens, kept or pruned, whose keys are most cosine-similar to its own, a_j their
    [CLS] attention (unnormalised weights), on the features before the projector
    (``merge_space='features'``); the projector then maps the merged features.

    Deviations: (1) the authors append one more token, the attention-weighted sum of the pruned tokens;
    it has no slot in the prompt and is left out; (2) kept tokens stay in prompt order at their own
    positions (harness rule; the authors' order is by attention, then the grid); (3) with no outlier the
    authors keep no token (PruMerge+ divides by zero), here one; (4) stable sorts (ties only).

    With ``adaptive=True`` the images of a batch must agree on the count, or a ValueError asks to run
    them one per batch. Knobs: ``adaptive``, ``plus`` (bools), ``neighbours`` (int >= 1).
    """
    budget = check_budget(inputs, "prumerge")
    _check_knobs(adaptive=adaptive, plus=plus, neighbours=neighbours)
    cls, keys = check_vision_last(inputs, "prumerge")
    check_features(inputs, "prumerge")
    if not adaptive and budget >= inputs.n_visual:
        return keep_all(inputs)
    selections = [_selection(cls[b], budget, adaptive, plus) for b in range(cls.shape[0])]
    same_count([s.numel() for s in selections], "prumerge", "adaptive=True (IQR outlier rule)")
    kept, merges = [], []
    for b, selected in enumerate(selections):
        order = selected.argsort()
        kept.append(selected[order])
        merges.append(_merge_rows(cls[b], keys[b], selected, neighbours)[order])
    return Selection(indices=torch.stack(kept), merge=torch.stack(merges), merge_space="features")


@register_method(
    "prumerge+",
    where="vision",
    needs=("vision_last", "features"),
    summary="PruMerge with spatially uniform tokens added to the [CLS]-attention ones",
    source="LLaVA-PruMerge+, Shang et al., ICCV 2025",
    check_knobs=partial(_check_knobs, plus=True),
)
def prumerge_plus(inputs: StageInputs, *, adaptive: bool = False, neighbours: int = 32) -> Selection:
    """PruMerge+ under its own name: :func:`prumerge` with ``plus=True`` (the authors'
    ``token_prune_merge_advanced_plus``, the one their ``CLIPVisionTower.forward`` calls).

    ``adaptive=True`` is the authors' default (IQR outliers plus their grid, the budget ignored);
    ``adaptive=False`` keeps K: ceil(K / 4) by [CLS] attention and the rest evenly spaced (no authors'
    counterpart at a fixed K, see :func:`prumerge`). Knobs: ``adaptive`` (bool), ``neighbours`` (int >= 1).
    """
    return prumerge(inputs, adaptive=adaptive, plus=True, neighbours=neighbours)
