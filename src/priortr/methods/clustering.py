"""Clustering of visual tokens for token recycling: K-means and SparseVLM's DPC-KNN.

Both are deterministic (ties go to the lower index), so a batch gives what each image gives alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from priortr.methods.tokens import descending


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
    centres, and every point joins its nearest centre. Computed in float32, or float64 for float64
    points. Deviation: the authors break density ties with uniform noise of 1e-6 (ties are systematic
    for C = 2, where two mutual nearest neighbours have the same density); here the lower index counts
    as denser, so the result is reproducible.
    """
    _check_cluster_args(points, n_clusters)
    points = points.to(torch.promote_types(points.dtype, torch.float32))
    distance = _distances(points, points) / math.sqrt(points.shape[1])  # [M, M]
    nearest = torch.sort(distance, dim=-1, stable=True).values[:, :n_clusters]  # [M, C]
    density = torch.exp(-(nearest**2).mean(dim=-1))  # [M]
    rank = torch.empty_like(density, dtype=torch.int64)
    rank[descending(density)] = torch.arange(points.shape[0], device=points.device)  # [M] 0 = densest
    denser = rank[None, :] < rank[:, None]  # [M, M] denser[i, j]: j is denser than i
    peak = distance.masked_fill(~denser, float("inf")).amin(dim=-1)  # [M]
    peak = torch.where(torch.isinf(peak), distance.max(), peak)
    centres = descending(peak * density)[:n_clusters]  # [C]
    labels = torch.argmin(distance[:, centres], dim=-1)  # [M]
    labels[centres] = torch.arange(n_clusters, device=points.device)
    return labels


CLUSTERINGS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {"kmeans": kmeans, "dpc_knn": dpc_knn}
