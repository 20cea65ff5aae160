"""SparseVLM (Zhang et al., "SparseVLM: Visual Token Sparsification for Efficient Vision-Language Model
Inference", ICML 2025): text raters score the visual tokens at a few decoder layers, and the best
pruned tokens are recycled as cluster means. Authors' code: github.com/Gumpest/SparseVLMs.
"""

from __future__ import annotations

import math

import torch

from priortr.methods.checks import check_budget, check_int, check_text_rows
from priortr.methods.groups import stack_plans
from priortr.methods.recycling import check_recycling, recycle_groups, split_budget
from priortr.methods.registry import register_method
from priortr.selection import Selection, StageInputs, keep_all

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


def _schedule(kept: int, n_visual: int, layer: int, n_layers: int) -> list[tuple[int, int]]:
    return sparsevlm_stages(kept, n_visual, n_layers)


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


@register_method(
    "sparsevlm",
    where="layers",
    needs=("attention", "text_rows"),
    schedule=_schedule,
    summary="attention of text raters, with pruned tokens recycled by clustering and merging",
    source="SparseVLM, Zhang et al., ICML 2025",
)
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
    check_recycling("sparsevlm", recycle_ratio, tokens_per_cluster, clustering)
    per_image = check_text_rows(inputs, "sparsevlm")
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
    return stack_plans(rows, inputs.n_visual)
