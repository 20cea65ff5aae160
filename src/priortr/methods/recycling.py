"""SparseVLM's token recycling: the best pruned tokens clustered and merged, shared with PriorTR+Merging.

Authors' code: github.com/Gumpest/SparseVLMs (``cluster_and_merge`` and the recycling in
``modelling_sparse_llama.py``); PriorTR's appendix "PriorTR+Merging Variant" reuses it with K-means.
"""

from __future__ import annotations

import math

import torch

from priortr.methods.clustering import CLUSTERINGS
from priortr.methods.groups import Group, plain_groups, uniform_group
from priortr.methods.tokens import descending
from priortr.methods.validate import check_fraction, check_int


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
    order = descending(scores)  # [N]
    kept, pruned = order[:n_kept], order[n_kept:]
    groups = plain_groups(kept)
    if n_clusters == 0:
        return groups
    n_candidates = min(pruned.numel(), math.floor(pruned.numel() * recycle_ratio) + 1)
    candidates = pruned[:n_candidates]  # [M], highest score first
    n_clusters = min(n_clusters, n_candidates)
    labels = CLUSTERINGS[clustering](hidden[candidates], n_clusters)  # [M]
    for cluster in range(n_clusters):
        members = candidates[labels == cluster]  # in descending score order
        groups.append(uniform_group(members, int(members[0])))
    return groups


def check_recycling(method: str, recycle_ratio: float, tokens_per_cluster: int, clustering: str) -> None:
    check_fraction(f"{method} recycle_ratio", recycle_ratio, open_low=True)
    check_int(f"{method} tokens_per_cluster", tokens_per_cluster, 1)
    if clustering not in CLUSTERINGS:
        raise ValueError(f"{method} clustering must be one of {sorted(CLUSTERINGS)}, got {clustering!r}")
