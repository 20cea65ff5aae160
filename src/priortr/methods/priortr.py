"""PriorTR (the paper): rank visual tokens by how much the instruction lifts their attention above the
model's instruction-free prior, S = P log((P + eps) / (Q + eps)) (Eq. (8)), and its merging variant.

Q is the separator row right after the image, P the mean of the instruction rows, both at the same
early decoder layer of one forward pass (Sec. 3.4; Appendix "Extracting Q and P").
"""

from __future__ import annotations

import torch

from priortr.methods.groups import stack_merges
from priortr.methods.recycling import check_recycling, recycle_counts, recycle_groups, split_budget
from priortr.methods.registry import register_method, register_rule
from priortr.methods.scoring import EPS, Evidence
from priortr.methods.selection import Selection, StageInputs, keep_all
from priortr.methods.validate import check_attention, check_bool, check_budget, check_text_rows, same_count


@register_rule(
    "priortr",
    summary="P * log((P + eps) / (Q + eps)): posterior mass times lift over the prior",
    source="PriorTR, Eq. (8) and Appendix 'Computing Scores'",
)
def priortr_score(evidence: Evidence) -> torch.Tensor:
    """Per-token contribution to the masked usable information (Eq. (7)), smoothed with eps."""
    p, q = evidence.posterior, evidence.prior  # [B, N]
    return p * torch.log((p + EPS) / (q + EPS))


def _rank_splits(inputs: StageInputs, recycle_ratio: float, tokens_per_cluster: int) -> list[tuple[int, int]]:
    """Per image (kept, clusters) with kept = rank of its text-to-visual attention [R, N] (at least 1)."""
    n_visual = inputs.n_visual
    splits = []
    for rows in check_text_rows(inputs, "priortr_merge"):
        kept = min(n_visual, max(1, int(torch.linalg.matrix_rank(rows))))
        splits.append((kept, recycle_counts(n_visual - kept, recycle_ratio, tokens_per_cluster)[1]))
    same_count([k + c for k, c in splits], "priortr_merge", "adaptive=True (attention rank)")
    return splits


def _check_merge_knobs(
    *, adaptive: bool, recycle_ratio: float, tokens_per_cluster: int, clustering: str
) -> None:
    check_bool("priortr_merge adaptive", adaptive)
    check_recycling("priortr_merge", recycle_ratio, tokens_per_cluster, clustering)


@register_method(
    "priortr+merge",
    where="layer",
    needs=("attention", "text_rows"),  # text_rows: the attention rank of adaptive=True
    summary="PriorTR ranking; the best pruned tokens clustered (K-means) and merged",
    source="PriorTR, Appendix 'PriorTR+Merging Variant'",
    check_knobs=_check_merge_knobs,
)
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
    _check_merge_knobs(
        adaptive=adaptive,
        recycle_ratio=recycle_ratio,
        tokens_per_cluster=tokens_per_cluster,
        clustering=clustering,
    )
    check_attention(inputs, "priortr_merge")
    scores = priortr_score(inputs.attention).float()  # [B, N]
    n_visual = inputs.n_visual
    if adaptive:
        splits = _rank_splits(inputs, recycle_ratio, tokens_per_cluster)
    elif budget >= n_visual:
        return keep_all(inputs)
    else:
        splits = [split_budget(n_visual, budget, recycle_ratio, tokens_per_cluster)] * scores.shape[0]
    rows = [
        recycle_groups(image_scores, hidden, k, c, recycle_ratio=recycle_ratio, clustering=clustering)
        for image_scores, hidden, (k, c) in zip(scores, inputs.hidden, splits, strict=True)
    ]
    return stack_merges(rows, n_visual)
