"""LLaVA-PruMerge and PruMerge+ (Shang et al., "LLaVA-PruMerge: Adaptive Token Reduction for Efficient
Large Multimodal Models", ICCV 2025): tokens kept by the vision tower's [CLS] attention, each absorbing
its key-nearest neighbours, before the LLM.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from priortr.methods.checks import check_bool, check_budget, check_int, check_vision, same_count
from priortr.methods.groups import Group, stack_plans
from priortr.methods.registry import register_method
from priortr.methods.tokens import descending
from priortr.selection import Selection, StageInputs, keep_all


def _iqr_outliers(cls: torch.Tensor) -> int:
    """How many values of ``cls`` [N] lie above Q3 + 1.5 IQR (quartiles interpolated as numpy does)."""
    q1, q3 = torch.quantile(cls, torch.tensor([0.25, 0.75], device=cls.device)).tolist()
    return int((cls > q3 + 1.5 * (q3 - q1)).sum())


def _prumerge_selection(cls: torch.Tensor, budget: int, adaptive: bool, plus: bool) -> torch.Tensor:
    """Indices of the tokens PruMerge(+) keeps for one image, from the [CLS] attention ``cls`` [N]."""
    order = descending(cls)  # [N]
    n_visual = cls.numel()
    n_top = budget
    if adaptive:
        n_top = max(1, _iqr_outliers(cls))
    elif plus:
        n_top = math.ceil(budget / 4)
    top = order[:n_top]
    if not plus:
        return top
    taken = torch.zeros(n_visual, dtype=torch.bool, device=cls.device)  # [N]
    taken[top] = True
    if adaptive:
        stride = max(1, (n_visual // n_top) // 3)
        grid = torch.arange(0, n_visual, stride, device=cls.device)
        return torch.cat([top, grid[~taken[grid]]])
    rest = (~taken).nonzero().squeeze(1)  # [N - n_top] ascending
    n_grid = budget - n_top
    if n_grid == 0:
        return top
    picks = ((torch.arange(n_grid, device=cls.device) + 0.5) * rest.numel() / n_grid).long()
    return torch.cat([top, rest[picks]])


def _prumerge_row(
    cls: torch.Tensor, keys: torch.Tensor, selected: torch.Tensor, neighbours: int
) -> list[Group]:
    """Each selected token absorbs its ``neighbours`` most key-similar tokens, weighted by [CLS] attention."""
    n_visual = cls.numel()
    metric = F.normalize(keys.transpose(0, 1).reshape(n_visual, -1), dim=-1)  # [N, H*d] all heads' keys
    similarity = metric[selected] @ metric.T  # [S, N]
    similarity[torch.arange(selected.numel(), device=cls.device), selected] = float("-inf")
    k = min(neighbours, n_visual - 1)
    nearest = torch.sort(similarity, dim=-1, descending=True, stable=True).indices[:, :k]  # [S, k]
    groups = []
    for centre, near in zip(selected.tolist(), nearest, strict=True):
        members = torch.cat([selected.new_tensor([centre]), near])
        weights = torch.cat([cls.new_ones(1), cls[near]])
        groups.append(Group(centre, members, weights))
    return groups


@register_method(
    "prumerge",
    where="vision",
    needs=("vision",),
    summary="[CLS]-attention selection, each kept token absorbing its nearest neighbours",
    source="LLaVA-PruMerge, Shang et al., ICCV 2025",
)
def prumerge(
    inputs: StageInputs, *, adaptive: bool = False, plus: bool = False, neighbours: int = 32
) -> Selection:
    """LLaVA-PruMerge(+): keep tokens by [CLS] attention, each absorbing its key-nearest neighbours.

    Shang et al., "LLaVA-PruMerge: Adaptive Token Reduction for Efficient Large Multimodal Models",
    ICCV 2025 (arXiv 2403.15388); authors' code: github.com/42Shawn/LLaVA-PruMerge,
    ``llava/model/multimodal_encoder/clip_encoder.py`` (``token_prune_merge_advanced`` and ``_plus``).
    Selection: the top K tokens by [CLS] attention; with ``adaptive=True`` the paper's rule instead,
    the tokens whose [CLS] attention is an outlier above Q3 + 1.5 IQR (at least one). ``plus=True`` is
    PruMerge+, which adds spatially uniform tokens: adaptively, the authors' grid (every
    ``(N // m) // 3``-th token, m outliers) minus tokens already kept; with a fixed K, ceil(K / 4) tokens
    by [CLS] attention (the ~1:3 ratio of the authors' adaptive grid) and K - ceil(K / 4) tokens evenly
    spaced, in sequence order, over the rest. Merging: every kept token p takes its ``neighbours``
    (default 32, the authors' inference code) most cosine-similar other tokens by key (all heads'
    keys concatenated, the authors' ``k_proj`` output) and becomes their weighted average, p with
    weight 1 and each neighbour j with its [CLS] attention a_j, as in the authors' update
    ``y_p + sum_j a_j y_j``, normalised by ``1 + sum_j a_j`` to meet the merge contract.

    With ``adaptive=True`` the kept count is the rule's, not ``inputs.budget`` (which is ignored); the
    images of a batch must then agree on it, or a ValueError asks to run them one per batch.

    Deviations: (1) the authors read the [CLS] attention of the vision tower's last layer, computed
    over all heads at once, while the features come from the penultimate; here both are the vision
    layer whose output the model uses and the attention is the head mean (``inputs.vision_cls``);
    (2) the authors append one extra token, the [CLS]-attention-weighted sum of all pruned tokens; it
    has no slot of its own and is not in the paper's algorithm, so it is left out; (3) the fixed-K
    rule and split above are this harness's adaptation to an equal token count.

    Requires ``inputs.hidden``, ``inputs.vision_cls`` [B, N] (softmax probabilities) and
    ``inputs.vision_keys`` [B, H, N, d]. Knobs: ``adaptive``, ``plus`` (bools), ``neighbours`` (int >= 1).
    """
    budget = check_budget(inputs, "prumerge")
    check_bool("prumerge adaptive", adaptive)
    check_bool("prumerge plus", plus)
    neighbours = check_int("prumerge neighbours", neighbours, 1)
    cls, keys = check_vision(inputs, "prumerge")
    if not adaptive and budget >= inputs.n_visual:
        return keep_all(inputs)
    selections = [_prumerge_selection(cls[b], budget, adaptive, plus) for b in range(cls.shape[0])]
    same_count([s.numel() for s in selections], "prumerge", "adaptive=True (IQR outlier rule)")
    rows = [_prumerge_row(cls[b], keys[b], s, neighbours) for b, s in enumerate(selections)]
    return stack_plans(rows, inputs.n_visual)
