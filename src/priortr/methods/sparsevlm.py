"""SparseVLM (Zhang et al., "SparseVLM: Visual Token Sparsification for Efficient Vision-Language Model
Inference", ICML 2025): text raters, chosen once from the input embeddings, score the visual tokens at
three decoder layers, and the best pruned tokens are recycled as cluster means on top of each stage's
count. Authors' code: github.com/Gumpest/SparseVLMs at 26a5f48813c46cd1c7364160354e7fdd3febaa67
(default ``USE_VERSION=1_0``).
"""

from __future__ import annotations

import math

import torch

from priortr.methods.groups import stack_merges
from priortr.methods.recycling import check_recycling, recycle_counts, recycle_groups, split_budget
from priortr.methods.registry import register_method
from priortr.methods.selection import Selection, StageInputs, keep_all
from priortr.methods.validate import check_budget, check_int

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
    layers 2, 6, 15 for every depth (e.g. 40-layer 13B). The counts are each stage's top-k: the
    recycled clusters come on top (``recycling='on_top'``, the authors') or inside them
    (``'in_budget'``). Returns [] when ``budget >= n_visual``.
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


RECYCLING = ("on_top", "in_budget")


def sparsevlm_raters(text: torch.Tensor, after_image: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
    """SparseVLM's text raters [B, R] (bool), chosen once, from the language model's input embeddings.

    Authors' code (``modelling_sparse_llama.py``, "Select Text Raters", paper Sec. 3.2): every token
    after the image (``after_image`` [B, R]) gets m = softmax over those tokens of (visual @ text^T),
    averaged over the image's input tokens ``visual`` [B, N0, D]; raters are the tokens whose m is
    above the mean m. ``text`` [B, R, D]. Computed in float32 or wider (the authors: the model's dtype).
    When no token is above the mean (one text token, or all equal), where the authors' code averages
    no row and its scores are NaN, every token after the image rates.
    """
    dtype = torch.promote_types(text.dtype, torch.float32)
    logits = visual.to(dtype) @ text.to(dtype).transpose(1, 2)  # [B, N0, R]
    logits = logits.masked_fill(~after_image[:, None, :], float("-inf"))
    relevance = logits.softmax(dim=-1).mean(dim=1)  # [B, R]
    mean = relevance.sum(dim=-1, keepdim=True) / after_image.sum(dim=-1, keepdim=True)  # [B, 1]
    raters = after_image & (relevance > mean)
    return torch.where(raters.any(dim=-1, keepdim=True), raters, after_image)


def _check_inputs(inputs: StageInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """text_rows [B, R, N] (float32), text_embeddings [B, R, D], text_after [B, R], visual_embeddings
    [B, N0, D], or a ValueError naming what is missing or misshapen."""
    batch, n_visual = inputs.hidden.shape[:2]
    fields = {
        "text_rows": inputs.text_rows,
        "text_embeddings": inputs.text_embeddings,
        "text_after": inputs.text_after,
        "visual_embeddings": inputs.visual_embeddings,
    }
    missing = [f"inputs.{name}" for name, value in fields.items() if value is None]
    if missing:
        raise ValueError(
            f"sparsevlm needs the instruction rows' attention and the input embeddings ({', '.join(missing)} "
            "missing): run it at a decoder layer through the engine, which gathers them for a method that "
            "declares 'attention', 'text_rows' and 'input_embeddings'"
        )
    rows, text, after, visual = fields.values()
    n_rows = rows.shape[1] if rows.ndim == 3 else -1
    shapes = {
        "text_rows [B, R, N]": rows.ndim == 3 and tuple(rows.shape[::2]) == (batch, n_visual),
        "text_embeddings [B, R, D]": text.ndim == 3 and tuple(text.shape[:2]) == (batch, n_rows),
        "text_after bool [B, R]": after.dtype == torch.bool and tuple(after.shape) == (batch, n_rows),
        "visual_embeddings [B, N0, D]": visual.ndim == 3
        and visual.shape[0] == batch
        and visual.shape[2] == text.shape[-1],
    }
    wrong = [name for name, ok in shapes.items() if not ok]
    if wrong:
        raise ValueError(
            f"sparsevlm: inputs.{', inputs.'.join(wrong)} do not fit B = {batch} images of N = {n_visual} "
            f"visual tokens and R = {n_rows} text rows"
        )
    return rows.float(), text, after, visual


def _check_knobs(*, recycling: str, recycle_ratio: float, tokens_per_cluster: int, clustering: str) -> None:
    if recycling not in RECYCLING:
        raise ValueError(f"sparsevlm recycling must be one of {list(RECYCLING)}, got {recycling!r}")
    check_recycling("sparsevlm", recycle_ratio, tokens_per_cluster, clustering)


@register_method(
    "sparsevlm",
    where="layers",
    needs=("attention", "text_rows", "input_embeddings"),
    schedule=sparsevlm_stages,
    summary="attention of text raters, with pruned tokens recycled by clustering and merging",
    source="SparseVLM, Zhang et al., ICML 2025",
    check_knobs=_check_knobs,
)
def sparsevlm(
    inputs: StageInputs,
    *,
    recycling: str = "on_top",
    recycle_ratio: float = 0.3,
    tokens_per_cluster: int = 10,
    clustering: str = "dpc_knn",
) -> Selection:
    """SparseVLM: text raters score the visual tokens; pruned tokens are partly recycled as cluster means.

    Zhang et al., ICML 2025 (arXiv 2410.04417); authors' code: github.com/Gumpest/SparseVLMs at
    26a5f48813c46cd1c7364160354e7fdd3febaa67, default ``USE_VERSION=1_0``:
    ``llava/model/language_model/modelling_sparse_llama.py`` (raters, recycling), ``score.py``
    (``attn_postprocess_topk``) and ``utils.py`` (``cluster_and_merge``).

    Raters (:func:`sparsevlm_raters`) come from the input embeddings, so every stage has the same. A
    visual token's score is the raters' mean attention on it at the stage's layer (softmax over every
    key, mean over heads, not renormalised over the visual tokens: ``inputs.text_rows``). The top
    ``inputs.budget`` are kept; of the pruned tokens the top ``floor(pruned * recycle_ratio) + 1`` by
    score are clustered on ``inputs.hidden`` into ``floor(count / tokens_per_cluster) + 1`` clusters
    (``clustering``: ``dpc_knn`` as the authors, or ``kmeans``), each averaged into one token.

    ``recycling``: ``on_top`` (the authors') adds the clusters to the budget, so a stage leaves more
    tokens than its count (576 tokens at "64": 66 + 16 = 82, then 30 + 2 = 32, then 17 + 1 = 18);
    ``in_budget`` fits kept + clusters into the budget (:func:`split_budget`), the harness's "K counts
    every visual token left". Deviations, by harness rule: a cluster takes the slot (position, cache
    entries) of its highest-scoring member, where the authors append it after the kept tokens with a
    renumbered position. Others: clusters are plain means (the authors divide the sum by count + 1e-6);
    DPC-kNN breaks density ties by index, the authors by 1e-6 noise (:func:`dpc_knn`); raters are
    computed in float32 or wider.
    """
    budget = check_budget(inputs, "sparsevlm")
    _check_knobs(
        recycling=recycling,
        recycle_ratio=recycle_ratio,
        tokens_per_cluster=tokens_per_cluster,
        clustering=clustering,
    )
    rows, text, after, visual = _check_inputs(inputs)
    n_visual = inputs.n_visual
    if budget >= n_visual:
        return keep_all(inputs)
    raters = sparsevlm_raters(text, after, visual).to(rows.dtype)  # [B, R]
    scores = (rows * raters[..., None]).sum(dim=1) / raters.sum(dim=1, keepdim=True)  # [B, N]
    if recycling == "on_top":
        n_kept, n_clusters = budget, recycle_counts(n_visual - budget, recycle_ratio, tokens_per_cluster)[1]
    else:
        n_kept, n_clusters = split_budget(n_visual, budget, recycle_ratio, tokens_per_cluster)
    merges = [
        recycle_groups(
            image_scores, hidden, n_kept, n_clusters, recycle_ratio=recycle_ratio, clustering=clustering
        )
        for image_scores, hidden in zip(scores, inputs.hidden, strict=True)
    ]
    selection = stack_merges(merges, n_visual)
    return Selection(indices=selection.indices, merge=selection.merge, scores=scores)
