"""Token-merging visual token selectors: VisionZip, LLaVA-PruMerge(+), SparseVLM and PriorTR+Merging.

These baselines do not only drop visual tokens: some survivors absorb the hidden states of tokens
that are pruned. Each selector is a pure tensor function ``StageInputs -> Selection``
(``priortr.selection``) whose ``merge`` rows say which tokens each survivor averages. The harness
compares methods at the same token count, so K = ``inputs.budget`` counts merged representatives
too (adaptive options excepted, see each docstring), and a merged representative takes the slot of
one of the tokens it merges, whose position and cache entries the engine keeps.

Shared machinery, used by several methods: :class:`Group` and :func:`merge_plan` turn "this slot
averages these tokens with these weights" into kept indices and merge rows; :func:`kmeans` and
:func:`dpc_knn` cluster tokens; :func:`recycle_counts`, :func:`split_budget` and
:func:`recycle_groups` implement SparseVLM's token recycling, which PriorTR+Merging reuses.

Images are processed one at a time, so a batch gives exactly what each image gives alone. Nothing is
random (K-means starts from a deterministic farthest-point initialisation), so ``inputs.seed`` is
not used; ties go to the lower token index. Computation is float32 on the inputs' device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from priortr.scoring import get_rule
from priortr.selection import Selection, StageInputs, keep_all
from priortr.selectors.checks import check_budget, check_int

_NO_CLS_HINT = (
    "this model's vision tower has no [CLS] token (e.g. Qwen2-VL): use divprune, dart or an in-LLM "
    "method such as sparsevlm"
)
_SPLIT_HINT = "run these images one per batch"


# --- validation -----------------------------------------------------------------------------------


def _check_fraction(name: str, value: object, *, open_low: bool = False) -> float:
    """A float knob in [0, 1] (or (0, 1] with ``open_low``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if not (0.0 < value <= 1.0 if open_low else 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in {'(0, 1]' if open_low else '[0, 1]'}, got {value!r}")
    return float(value)


def _check_vision(inputs: StageInputs, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision tower's [CLS] attention [B, N] and keys [B, H, N, d], float32, or a ValueError."""
    batch, n_visual = inputs.hidden.shape[:2]
    cls, keys = inputs.vision_cls, inputs.vision_keys
    if cls is None or keys is None:
        missing = " and ".join(
            name
            for name, value in (("inputs.vision_cls", cls), ("inputs.vision_keys", keys))
            if value is None
        )
        raise ValueError(
            f"{method} needs the vision tower's [CLS] attention and keys ({missing} missing); {_NO_CLS_HINT}"
        )
    if tuple(cls.shape) != (batch, n_visual):
        raise ValueError(
            f"{method}: inputs.vision_cls must be [B, N] = {(batch, n_visual)}, got {tuple(cls.shape)}"
        )
    if keys.ndim != 4 or keys.shape[0] != batch or keys.shape[2] != n_visual:
        raise ValueError(
            f"{method}: inputs.vision_keys must be [B, H, N, d] with B, N = {(batch, n_visual)}, "
            f"got {tuple(keys.shape)}"
        )
    if not (torch.isfinite(cls).all() and torch.isfinite(keys).all()):
        raise ValueError(f"{method}: inputs.vision_cls or inputs.vision_keys contains NaN or inf")
    return cls.float(), keys.float()


def _check_text_rows(inputs: StageInputs, method: str) -> list[torch.Tensor]:
    """Per image, the valid instruction rows' attention over the visual tokens [R_b, N], float32."""
    batch, n_visual = inputs.hidden.shape[:2]
    rows, valid = inputs.text_rows, inputs.text_valid
    if rows is None or valid is None:
        raise ValueError(
            f"{method} needs the instruction rows' attention over the visual tokens (inputs.text_rows and "
            "inputs.text_valid), which exist only at a stage inside the language model; run it at a decoder "
            "layer, or use visionzip or prumerge before the language model"
        )
    if rows.ndim != 3 or rows.shape[0] != batch or rows.shape[2] != n_visual:
        raise ValueError(
            f"{method}: inputs.text_rows must be [B, R, N] with B, N = {(batch, n_visual)}, "
            f"got {tuple(rows.shape)}"
        )
    if valid.dtype != torch.bool or tuple(valid.shape) != tuple(rows.shape[:2]):
        raise ValueError(
            f"{method}: inputs.text_valid must be bool [B, R] = {tuple(rows.shape[:2])}, "
            f"got {valid.dtype} {tuple(valid.shape)}"
        )
    per_image = [image_rows[image_valid].float() for image_rows, image_valid in zip(rows, valid, strict=True)]
    for index, image_rows in enumerate(per_image):
        if image_rows.shape[0] == 0:
            raise ValueError(f"{method}: image {index} has no valid instruction row (inputs.text_valid)")
        if not torch.isfinite(image_rows).all():
            raise ValueError(f"{method}: inputs.text_rows of image {index} contains NaN or inf")
    return per_image


def _same_count(counts: list[int], method: str, rule: str) -> None:
    """Adaptive counts must agree across the batch: a Selection has one K for every image."""
    if len(set(counts)) > 1:
        raise ValueError(
            f"{method}: {rule} gives a different number of tokens per image ({counts}) but a batch shares "
            f"one count; {_SPLIT_HINT}"
        )


# --- merge plans ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """One survivor: the slot it occupies and the tokens whose hidden states it averages.

    Attributes:
        slot: index of the visual token whose position and cache entries the survivor keeps; must be
            one of ``members``.
        members: [M] int64 distinct indices of the merged tokens (a plainly kept token: ``[slot]``).
        weights: [M] non-negative weights, not all zero; normalised to sum to 1 by :func:`merge_plan`.
    """

    slot: int
    members: torch.Tensor
    weights: torch.Tensor


def plain_groups(indices: torch.Tensor) -> list[Group]:
    """Groups that keep each of ``indices`` [K] with its own hidden state (one-hot merge rows)."""
    one = torch.ones(1, dtype=torch.float32, device=indices.device)
    return [Group(int(i), indices[j : j + 1], one) for j, i in enumerate(indices.tolist())]


def uniform_group(members: torch.Tensor, slot: int) -> Group:
    """A group averaging ``members`` [M] with equal weights, placed at ``slot``."""
    weights = torch.ones(members.shape[0], dtype=torch.float32, device=members.device)
    return Group(slot, members, weights)


def merge_plan(groups: list[Group], n_visual: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept slots [K] (ascending) and merge rows [K, N] (each summing to 1) for one image's groups."""
    groups = sorted(groups, key=lambda group: group.slot)
    slots = [group.slot for group in groups]
    if len(set(slots)) != len(slots):
        raise ValueError(f"two merge groups share a slot: {slots}")
    device = groups[0].members.device
    merge = torch.zeros(len(groups), n_visual, dtype=torch.float32, device=device)  # [K, N]
    for row, group in enumerate(groups):
        if group.slot not in group.members.tolist():
            raise ValueError(f"merge group slot {group.slot} is not one of its members")
        weights = group.weights.float()
        merge[row].index_add_(0, group.members, weights / weights.sum())
    return torch.tensor(slots, dtype=torch.int64, device=device), merge


def _stack_plans(per_image: list[list[Group]], n_visual: int) -> Selection:
    """Stack each image's groups into a Selection; ``merge`` is None when every group is a plain keep."""
    plans = [merge_plan(groups, n_visual) for groups in per_image]
    kept = torch.stack([slots for slots, _ in plans])  # [B, K]
    if all(group.members.numel() == 1 for groups in per_image for group in groups):
        return Selection(kept=kept)
    return Selection(kept=kept, merge=torch.stack([merge for _, merge in plans]))  # [B, K, N]


def _descending(scores: torch.Tensor) -> torch.Tensor:
    """Indices of ``scores`` [N] from highest to lowest; equal scores keep the lower index first."""
    return torch.sort(scores, descending=True, stable=True).indices


# --- clustering -----------------------------------------------------------------------------------


def _check_cluster_args(points: torch.Tensor, n_clusters: int) -> None:
    if points.ndim != 2:
        raise ValueError(f"points must be [M, D], got shape {tuple(points.shape)}")
    n_points = points.shape[0]
    if isinstance(n_clusters, bool) or not isinstance(n_clusters, int) or not 1 <= n_clusters <= n_points:
        raise ValueError(f"n_clusters must be an int in [1, M = {n_points}], got {n_clusters!r}")


def _distances(points: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Euclidean distances [M, C], computed exactly (no matmul expansion) so ties are reproducible."""
    return torch.cdist(points, centres, compute_mode="donot_use_mm_for_euclid_dist")


def _farthest_point_init(points: torch.Tensor, n_clusters: int) -> torch.Tensor:
    """Initial centre indices [C]: point 0, then repeatedly the point farthest from every chosen centre."""
    nearest = _distances(points, points[:1]).squeeze(1)  # [M]
    chosen = [0]
    for _ in range(n_clusters - 1):
        candidates = nearest.clone()
        candidates[chosen] = -1.0
        index = int(torch.argmax(candidates))  # first maximum: lowest index
        chosen.append(index)
        nearest = torch.minimum(nearest, _distances(points, points[index : index + 1]).squeeze(1))
    return torch.tensor(chosen, dtype=torch.int64, device=points.device)


def _assign(points: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Nearest-centre labels [M] (ties to the lower centre), with no cluster left empty.

    An empty cluster takes the point farthest from its own centre among clusters of two or more
    members, the usual K-means repair, so exactly C clusters always come out.
    """
    distance = _distances(points, centres)  # [M, C]
    labels = torch.argmin(distance, dim=-1)  # [M]
    n_clusters = centres.shape[0]
    for cluster in range(n_clusters):
        sizes = torch.bincount(labels, minlength=n_clusters)  # [C]
        if sizes[cluster] > 0:
            continue
        own = distance.gather(1, labels[:, None]).squeeze(1)  # [M]
        movable = sizes[labels] > 1  # [M]
        labels[int(torch.argmax(own.masked_fill(~movable, -1.0)))] = cluster
    return labels


def kmeans(points: torch.Tensor, n_clusters: int, *, max_iter: int = 100) -> torch.Tensor:
    """Lloyd's K-means on ``points`` [M, D]: labels [M] in [0, C), every cluster non-empty.

    Deterministic: centres start at point 0 and then the farthest points (Gonzalez's farthest-point
    initialisation), so callers put their most important point first; iterations stop when the
    labels no longer change or after ``max_iter`` rounds.
    """
    _check_cluster_args(points, n_clusters)
    points = points.float()
    centres = points[_farthest_point_init(points, n_clusters)]  # [C, D]
    labels = _assign(points, centres)
    for _ in range(max_iter):
        counts = torch.bincount(labels, minlength=n_clusters).to(points.dtype)  # [C]
        sums = torch.zeros_like(centres).index_add_(0, labels, points)  # [C, D]
        centres = sums / counts[:, None]
        updated = _assign(points, centres)
        if torch.equal(updated, labels):
            break
        labels = updated
    return labels


def dpc_knn(points: torch.Tensor, n_clusters: int) -> torch.Tensor:
    """Density-peak clustering with k-nearest-neighbour density (DPC-KNN): labels [M] in [0, C).

    The clustering of SparseVLM's token recycling (authors' code: github.com/Gumpest/SparseVLMs,
    ``llava/model/language_model/utils.py``, ``cluster_and_merge``). Distances are Euclidean divided
    by sqrt(D); a point's density is exp(-mean squared distance to its k = C nearest points, itself
    included); its peak distance is the distance to the nearest point of higher density (the largest
    distance for the densest point). The C points with the largest density x peak distance are the
    centres, and every point joins its nearest centre. Deviation: the authors break density ties
    with uniform noise of 1e-6; here the lower index counts as denser, so the result is reproducible.
    """
    _check_cluster_args(points, n_clusters)
    points = points.float()
    distance = _distances(points, points) / math.sqrt(points.shape[1])  # [M, M]
    nearest = torch.sort(distance, dim=-1, stable=True).values[:, :n_clusters]  # [M, C]
    density = torch.exp(-(nearest**2).mean(dim=-1))  # [M]
    rank = torch.empty_like(density, dtype=torch.int64)
    rank[_descending(density)] = torch.arange(points.shape[0], device=points.device)  # [M] 0 = densest
    denser = rank[None, :] < rank[:, None]  # [M, M] denser[i, j]: j is denser than i
    peak = distance.masked_fill(~denser, float("inf")).amin(dim=-1)  # [M]
    peak = torch.where(torch.isinf(peak), distance.max(), peak)
    centres = _descending(peak * density)[:n_clusters]  # [C]
    labels = torch.argmin(distance[:, centres], dim=-1)  # [M]
    labels[centres] = torch.arange(n_clusters, device=points.device)
    return labels


CLUSTERINGS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {"kmeans": kmeans, "dpc_knn": dpc_knn}


# --- SparseVLM token recycling (shared with PriorTR+Merging) ---------------------------------------


def recycle_counts(n_pruned: int, recycle_ratio: float, tokens_per_cluster: int) -> tuple[int, int]:
    """(candidates, clusters) that SparseVLM's recycling draws from ``n_pruned`` pruned tokens.

    The top ``floor(n_pruned * recycle_ratio) + 1`` pruned tokens by score are candidates, grouped into
    ``floor(candidates / tokens_per_cluster) + 1`` clusters (authors' code: ``int(n * 0.3) + 1`` and
    ``int(n / 10) + 1``); nothing is recycled when nothing is pruned.
    """
    if n_pruned == 0:
        return 0, 0
    candidates = min(n_pruned, math.floor(n_pruned * recycle_ratio) + 1)
    return candidates, min(candidates, candidates // tokens_per_cluster + 1)


def split_budget(
    n_visual: int, budget: int, recycle_ratio: float, tokens_per_cluster: int
) -> tuple[int, int]:
    """Split a total of K < N survivors into (kept, clusters) with kept + clusters = K.

    SparseVLM keeps its top-k and appends the recycled clusters on top; with a fixed total the largest
    k whose recycling count fits is kept, ``k + clusters(N - k) = K`` (the count grows by 0 or 1 per
    extra kept token, so this k exists). When even k = 0 would recycle more than K clusters, all K
    survivors are clusters.
    """
    for kept in range(budget - 1, -1, -1):
        clusters = recycle_counts(n_visual - kept, recycle_ratio, tokens_per_cluster)[1]
        if kept + clusters <= budget:
            return kept, budget - kept
    return 0, budget


def recycle_groups(
    scores: torch.Tensor,
    hidden: torch.Tensor,
    n_kept: int,
    n_clusters: int,
    *,
    recycle_ratio: float,
    clustering: str,
) -> list[Group]:
    """One image's survivors: the top ``n_kept`` by ``scores`` [N] and ``n_clusters`` recycled clusters.

    Among the pruned tokens, the top ``floor(pruned * recycle_ratio) + 1`` by score are clustered on
    ``hidden`` [N, D]; each cluster becomes the plain average of its members (SparseVLM averages with
    unit weights) and sits in the slot of its highest-scoring member. The other pruned tokens go.
    """
    order = _descending(scores)  # [N]
    kept, pruned = order[:n_kept], order[n_kept:]
    groups = plain_groups(kept)
    if n_clusters == 0:
        return groups
    n_candidates = min(pruned.numel(), math.floor(pruned.numel() * recycle_ratio) + 1)
    candidates = pruned[:n_candidates]  # [M], highest score first
    n_clusters = min(n_clusters, n_candidates)
    labels = CLUSTERINGS[clustering](hidden[candidates].float(), n_clusters)  # [M]
    for cluster in range(n_clusters):
        members = candidates[labels == cluster]  # in descending score order
        groups.append(uniform_group(members, int(members[0])))
    return groups


def _check_recycling(method: str, recycle_ratio: float, tokens_per_cluster: int, clustering: str) -> None:
    _check_fraction(f"{method} recycle_ratio", recycle_ratio, open_low=True)
    check_int(f"{method} tokens_per_cluster", tokens_per_cluster, 1)
    if clustering not in CLUSTERINGS:
        raise ValueError(f"{method} clustering must be one of {sorted(CLUSTERINGS)}, got {clustering!r}")


# --- VisionZip ------------------------------------------------------------------------------------


def _visionzip_row(cls: torch.Tensor, keys: torch.Tensor, budget: int, n_contextual: int) -> list[Group]:
    """VisionZip on one image: ``cls`` [N], ``keys`` [H, N, d]."""
    order = _descending(cls)  # [N]
    n_dominant = budget - n_contextual
    groups = plain_groups(order[:n_dominant])
    if n_contextual == 0:
        return groups
    rest = order[n_dominant:].sort().values  # [R] remaining tokens in sequence order
    metric = F.normalize(keys.mean(dim=0)[rest], dim=-1)  # [R, d] head-mean keys, unit length
    step = max(1, rest.numel() // n_contextual)
    is_target = torch.zeros(rest.numel(), dtype=torch.bool, device=rest.device)  # [R]
    target_pos = torch.arange(0, rest.numel(), step, device=rest.device)[:n_contextual]  # [C]
    is_target[target_pos] = True
    similarity = metric[~is_target] @ metric[target_pos].T  # [R - C, C]
    assignment = torch.argmax(similarity, dim=-1)  # [R - C] first maximum: earliest target
    targets, others = rest[target_pos], rest[~is_target]  # [C], [R - C]
    for position in range(n_contextual):
        members = torch.cat([targets[position : position + 1], others[assignment == position]])
        groups.append(uniform_group(members, int(targets[position])))
    return groups


def visionzip(inputs: StageInputs, *, contextual_ratio: float = 10 / 64) -> Selection:
    """VisionZip: keep the tokens the vision tower's [CLS] attends to most, merge the rest by key similarity.

    Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language Models", CVPR 2025
    (arXiv 2412.04467); authors' code: github.com/dvlab-research/VisionZip, ``visionzip/clip_encoder.py``
    and ``visionzip/utils.py``. Dominant tokens: the top (K - C) by [CLS] attention (the authors sum it
    over heads; the head mean ranks identically). Contextual tokens: the remaining R tokens, in sequence
    order, are split into C targets (every ``R // C``-th token, the first C of them) and the others;
    each other token joins the target whose key is most cosine-similar, keys averaged over heads as the
    authors do (``key_states.mean(1)``), and each target becomes the mean hidden state of itself and
    the tokens that joined it, in the target's slot.

    Default split: the authors publish 54 dominant + 10 contextual for 64 tokens (README); 108 + 20 and
    162 + 30, the splits used for 128 and 192 (not checked against the paper's text here), share that
    ratio: C = round(K * ``contextual_ratio``) with ratio 10/64.

    Deviations: (1) the authors also keep the [CLS] token as one of the dominant tokens (``dominant=54``
    keeps [CLS] + 53 patches); the language model here sees only patch tokens, so all K - C dominant
    tokens are patches; (2) the authors' contextual token is target + mean of the joined tokens (weights
    summing to 2), here the mean over target and joined tokens (a convex combination, as the merge
    contract requires); (3) with no token joining a target, the
    target is kept as is, as in the authors' code.

    Requires ``inputs.hidden``, ``inputs.vision_cls`` [B, N] and ``inputs.vision_keys`` [B, H, N, d].
    Knob: ``contextual_ratio`` in [0, 1], the share of K that is contextual tokens.
    """
    budget = check_budget(inputs, "visionzip")
    contextual_ratio = _check_fraction("visionzip contextual_ratio", contextual_ratio)
    cls, keys = _check_vision(inputs, "visionzip")
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    n_contextual = math.floor(budget * contextual_ratio + 0.5)
    rows = [_visionzip_row(cls[b], keys[b], budget, n_contextual) for b in range(cls.shape[0])]
    return _stack_plans(rows, inputs.n_visual)


# --- LLaVA-PruMerge -------------------------------------------------------------------------------


def _iqr_outliers(cls: torch.Tensor) -> int:
    """How many values of ``cls`` [N] lie above Q3 + 1.5 IQR (quartiles interpolated as numpy does)."""
    q1, q3 = torch.quantile(cls, torch.tensor([0.25, 0.75], device=cls.device)).tolist()
    return int((cls > q3 + 1.5 * (q3 - q1)).sum())


def _prumerge_selection(cls: torch.Tensor, budget: int, adaptive: bool, plus: bool) -> torch.Tensor:
    """Indices of the tokens PruMerge(+) keeps for one image, from the [CLS] attention ``cls`` [N]."""
    order = _descending(cls)  # [N]
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
    if not isinstance(adaptive, bool) or not isinstance(plus, bool):
        raise ValueError(f"prumerge adaptive and plus must be bools, got {adaptive!r} and {plus!r}")
    neighbours = check_int("prumerge neighbours", neighbours, 1)
    cls, keys = _check_vision(inputs, "prumerge")
    if not adaptive and budget >= inputs.n_visual:
        return keep_all(inputs)
    selections = [_prumerge_selection(cls[b], budget, adaptive, plus) for b in range(cls.shape[0])]
    _same_count([s.numel() for s in selections], "prumerge", "adaptive=True (IQR outlier rule)")
    rows = [_prumerge_row(cls[b], keys[b], s, neighbours) for b, s in enumerate(selections)]
    return _stack_plans(rows, inputs.n_visual)


# --- SparseVLM ------------------------------------------------------------------------------------


def _rater_scores(rows: torch.Tensor) -> torch.Tensor:
    """SparseVLM's visual scores for one image from its instruction rows' attention ``rows`` [R, N].

    Raters are the instruction tokens whose relevance to the image is above the mean relevance; a
    token's relevance is its share of each visual token's attention from the instruction (each column
    normalised over the rows), averaged over the visual tokens. The visual score is the raters' mean
    attention [N]. With every relevance equal, every row rates.
    """
    column = rows.sum(dim=0, keepdim=True)  # [1, N]
    share = torch.where(column > 0, rows / column.clamp_min(torch.finfo(rows.dtype).tiny), 0.0)  # [R, N]
    relevance = share.mean(dim=-1)  # [R]
    raters = relevance > relevance.mean()
    if not raters.any():
        raters = torch.ones_like(raters)
    return rows[raters].mean(dim=0)  # [N]


def sparsevlm(
    inputs: StageInputs,
    *,
    recycle_ratio: float = 0.3,
    tokens_per_cluster: int = 10,
    clustering: str = "dpc_knn",
) -> Selection:
    """SparseVLM: text raters score the visual tokens; pruned tokens are partly recycled as cluster means.

    Zhang et al., "SparseVLM: Visual Token Sparsification for Efficient Vision-Language Model
    Inference", ICML 2025 (arXiv 2410.04417); authors' code: github.com/Gumpest/SparseVLMs,
    ``llava/model/language_model/modelling_sparse_llama.py`` (rater selection, recycling),
    ``score.py`` (``attn_postprocess_topk``) and ``utils.py`` (``cluster_and_merge``). Raters: the
    instruction tokens more relevant to the image than average (see ``_rater_scores``); visual score:
    the raters' head-mean attention. The top-scoring tokens are kept; of the pruned tokens, the top
    ``floor(pruned * recycle_ratio) + 1`` by score are clustered on ``inputs.hidden`` into
    ``floor(count / tokens_per_cluster) + 1`` clusters (``clustering``: ``dpc_knn``, the authors'
    density-peak clustering, or ``kmeans``), each averaged into one token in the slot of its
    highest-scoring member. Kept + clusters = K (see :func:`split_budget`); :func:`sparsevlm_stages` is
    the multi-layer schedule.

    Deviations: (1) the authors rate text relevance by softmax(visual hidden @ text hidden^T) over the
    text tokens at the language model's input; a selector sees no text hidden states, so relevance is
    the same statistic on the instruction rows' attention (each visual column normalised over rows);
    (2) the authors append the recycled tokens after the kept ones, on top of their top-k; here they
    occupy a member's slot and count in K; (3) deterministic tie-breaking in DPC-KNN (:func:`dpc_knn`).

    Requires ``inputs.hidden``, ``inputs.text_rows`` [B, R, N] and ``inputs.text_valid`` [B, R].
    Knobs: ``recycle_ratio`` in (0, 1], ``tokens_per_cluster`` >= 1, ``clustering``.
    """
    budget = check_budget(inputs, "sparsevlm")
    _check_recycling("sparsevlm", recycle_ratio, tokens_per_cluster, clustering)
    per_image = _check_text_rows(inputs, "sparsevlm")
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    n_kept, n_clusters = split_budget(inputs.n_visual, budget, recycle_ratio, tokens_per_cluster)
    rows = [
        recycle_groups(
            _rater_scores(image_rows),
            hidden,
            n_kept,
            n_clusters,
            recycle_ratio=recycle_ratio,
            clustering=clustering,
        )
        for image_rows, hidden in zip(per_image, inputs.hidden, strict=True)
    ]
    return _stack_plans(rows, inputs.n_visual)


_SPARSEVLM_DEPTH = 32
_SPARSEVLM_TOKENS = 576
_SPARSEVLM_LAYERS = (2, 6, 15)
_SPARSEVLM_SCHEDULES = {64: (66, 30, 17), 96: (238, 48, 26), 128: (303, 110, 36), 192: (300, 200, 110)}


def sparsevlm_stages(budget: int, n_visual: int, n_layers: int) -> list[tuple[int, int]]:
    """SparseVLM's multi-layer schedule: [(0-indexed scored layer, visual tokens kept after it), ...].

    Published for LLaVA-1.5-7B (32 layers, 576 tokens), github.com/Gumpest/SparseVLMs: pruning at
    decoder layers 2, 6 and 15 (``pruning_loc`` in ``modelling_sparse_llama.py``), keeping
    (66, 30, 17) for 64 tokens, (238, 48, 26) for 96, (303, 110, 36) for 128 and (300, 200, 110) for
    192 (``score.py``, default version 1.0), counts whose average over the 32 layers is about the
    budget. Those exact stages are returned for 32 layers and 576 tokens.

    Elsewhere (a proposal, documented, not the authors'): the published schedule whose budget share
    of 576 is nearest to ``budget / n_visual`` (ties: the larger) is scaled by budget / its budget,
    clamped to [1, N] and made non-increasing; the layers are scaled by ``n_layers / 32`` (made
    strictly increasing) so the same fraction of the depth runs at each count. The authors' code keeps
    layers 2, 6, 15 for every depth (e.g. 40-layer 13B). Under this harness's rule the counts include
    the recycled cluster tokens, which the authors add on top. Returns [] when ``budget >= n_visual``.
    """
    check_int("sparsevlm budget", budget, 1)
    check_int("sparsevlm n_visual", n_visual, 1)
    check_int("sparsevlm n_layers", n_layers, 1)
    if budget >= n_visual:
        return []
    share = budget / n_visual
    reference = min(_SPARSEVLM_SCHEDULES, key=lambda b: (abs(b / _SPARSEVLM_TOKENS - share), -b))
    scale = budget / reference
    counts: list[int] = []
    for count in _SPARSEVLM_SCHEDULES[reference]:
        scaled = min(n_visual, max(1, math.floor(count * scale + 0.5)))
        counts.append(min(scaled, counts[-1]) if counts else scaled)
    layers: list[int] = []
    for layer in _SPARSEVLM_LAYERS:
        scaled = math.floor(layer * n_layers / _SPARSEVLM_DEPTH + 0.5)
        layers.append(max(scaled, layers[-1] + 1) if layers else scaled)
    if layers[-1] > n_layers - 2:
        raise ValueError(
            f"sparsevlm needs at least 4 decoder layers for its 3 pruning stages, the model has {n_layers}"
        )
    return list(zip(layers, counts, strict=True))


# --- PriorTR+Merging ------------------------------------------------------------------------------


def _check_attention(inputs: StageInputs) -> torch.Tensor:
    """PriorTR's scores S = P log((P + eps) / (Q + eps)) [B, N] from ``inputs.attention``."""
    evidence = inputs.attention
    if evidence is None:
        raise ValueError(
            "priortr_merge needs the prior and posterior attention (inputs.attention), gathered at a decoder "
            "layer; run it at a layer inside the language model"
        )
    if tuple(evidence.posterior.shape) != tuple(inputs.hidden.shape[:2]):
        raise ValueError(
            f"priortr_merge: inputs.attention is over {tuple(evidence.posterior.shape)} (images, tokens) but "
            f"inputs.hidden over {tuple(inputs.hidden.shape[:2])}"
        )
    return get_rule("priortr").fn(evidence).float()  # [B, N]


def _rank_plans(inputs: StageInputs, recycle_ratio: float, tokens_per_cluster: int) -> list[tuple[int, int]]:
    """Per image (kept, clusters) with kept = rank of its text-to-visual attention [R, N] (at least 1)."""
    n_visual = inputs.n_visual
    plans = []
    for rows in _check_text_rows(inputs, "priortr_merge"):
        kept = min(n_visual, max(1, int(torch.linalg.matrix_rank(rows))))
        plans.append((kept, recycle_counts(n_visual - kept, recycle_ratio, tokens_per_cluster)[1]))
    _same_count([k + c for k, c in plans], "priortr_merge", "adaptive=True (attention rank)")
    return plans


def priortr_merge(
    inputs: StageInputs,
    *,
    adaptive: bool = False,
    recycle_ratio: float = 0.3,
    tokens_per_cluster: int = 10,
    clustering: str = "kmeans",
) -> Selection:
    """PriorTR+Merging: SparseVLM's cluster-and-merge recycling driven by PriorTR's scores.

    PriorTR paper, appendix "PriorTR+Merging Variant": tokens are ranked by S = P log((P+eps)/(Q+eps));
    the top tokens are kept; among the rest, the top 30% by S (``floor(count * recycle_ratio) + 1``, as
    SparseVLM's code counts) are K-means clustered on ``inputs.hidden`` into ``floor(count / 10) + 1``
    clusters, each merged into one representative (plain mean, in the slot of its highest-S member).
    The recycling is :func:`recycle_groups`, shared with :func:`sparsevlm`.

    Budget: with a fixed K, kept + representatives = K, kept being the largest count whose recycling
    fits (:func:`split_budget`; e.g. K = 64 of N = 576 keeps 48 and merges 16 clusters). With
    ``adaptive=True``, as in the paper, the kept count is the matrix rank of the text-to-visual
    attention (the valid ``inputs.text_rows`` [R, N] of each image, float32 ``torch.linalg.matrix_rank``,
    at least 1) and the representatives come on top, so the total is adaptive and ``inputs.budget`` is
    ignored; images of a batch with different totals raise a ValueError asking to run them one per batch.

    Requires ``inputs.hidden`` and ``inputs.attention``; ``adaptive=True`` also ``inputs.text_rows`` and
    ``inputs.text_valid``. Knobs: ``adaptive``, ``recycle_ratio`` in (0, 1], ``tokens_per_cluster`` >= 1,
    ``clustering`` (``kmeans`` as the paper says, or ``dpc_knn`` as SparseVLM's code clusters).
    """
    budget = check_budget(inputs, "priortr_merge")
    if not isinstance(adaptive, bool):
        raise ValueError(f"priortr_merge adaptive must be a bool, got {adaptive!r}")
    _check_recycling("priortr_merge", recycle_ratio, tokens_per_cluster, clustering)
    scores = _check_attention(inputs)
    n_visual = inputs.n_visual
    if adaptive:
        plans = _rank_plans(inputs, recycle_ratio, tokens_per_cluster)
    elif budget >= n_visual:
        return keep_all(inputs)
    else:
        plans = [split_budget(n_visual, budget, recycle_ratio, tokens_per_cluster)] * scores.shape[0]
    rows = [
        recycle_groups(image_scores, hidden, k, c, recycle_ratio=recycle_ratio, clustering=clustering)
        for image_scores, hidden, (k, c) in zip(scores, inputs.hidden, plans, strict=True)
    ]
    return _stack_plans(rows, n_visual)
