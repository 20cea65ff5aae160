"""Diversity-based visual token selectors: DivPrune, DART and VisPruner.

These baselines keep visual tokens that are *not redundant* instead of tokens that some attention
row ranks highly. Each is a pure tensor function ``StageInputs -> Selection`` (``priortr.selection``)
that keeps exactly K = ``inputs.budget`` visual tokens per image, without merging. Images are
processed one at a time, so a batch gives exactly what each image gives alone; every choice is
deterministic, with ties going to the lower token index. Features are compared in float32 by cosine
similarity on unit vectors (a zero vector is similar to nothing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from priortr.selection import Selection, StageInputs, keep_all
from priortr.selectors.checks import check_budget, check_int


def _unit(features: torch.Tensor) -> torch.Tensor:
    """Rows of ``features`` [N, D] scaled to unit L2 norm in float32, so dot products are cosines."""
    return F.normalize(features.float(), dim=-1)


def _stack_rows(rows: list[torch.Tensor]) -> Selection:
    """Stack per-image index sets [K] into a Selection with ascending rows [B, K]."""
    return Selection(kept=torch.stack([row.sort().values for row in rows]))


# --- DivPrune -------------------------------------------------------------------------------------


def _divprune_row(features: torch.Tensor, budget: int) -> torch.Tensor:
    """Greedy max-min diversity subset of ``budget`` rows of ``features`` [N, D]; returns [K] indices.

    The first token is the one whose nearest other token is farthest; each next token maximises its
    distance to the nearest token already chosen. Distance is 1 - cosine similarity.
    """
    unit = _unit(features)  # [N, D]
    distance = 1.0 - unit @ unit.T  # [N, N]
    n_visual = distance.shape[0]
    self_pairs = torch.eye(n_visual, dtype=torch.bool, device=distance.device)  # [N, N]
    score = distance.masked_fill(self_pairs, float("inf")).amin(dim=-1)  # [N] nearest-other distance
    nearest_chosen = torch.full_like(score, float("inf"))  # [N]
    taken = torch.zeros(n_visual, dtype=torch.bool, device=distance.device)  # [N]
    chosen = []
    for _ in range(budget):
        index = torch.argmax(score.masked_fill(taken, float("-inf")))  # first maximum: lowest index
        chosen.append(index)
        taken[index] = True
        nearest_chosen = torch.minimum(nearest_chosen, distance[index])
        score = nearest_chosen
    return torch.stack(chosen)  # [K]


def divprune(inputs: StageInputs) -> Selection:
    """DivPrune: keep the K visual tokens that greedily solve the max-min diversity problem.

    Alvar et al., "DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models",
    CVPR 2025 (arXiv 2503.02175); authors' code: github.com/vbdi/divprune,
    ``LLaVA/llava/model/llava_arch.py`` (``DivPrune``). Pruning before the language model (their
    ``LAYER_INDEX=0``), on the LLM input embeddings of the visual tokens, i.e. ``inputs.hidden`` of a
    vision stage. Distance d(i, j) = 1 - cos(h_i, h_j). The first token maximises the distance to its
    nearest other token; each further token maximises the minimum distance to the tokens already
    chosen (greedy MMDP). The authors' only knob is the kept ratio, here the budget K.

    Deviation: tokens already chosen are excluded from later picks, so K distinct tokens are kept
    even when the remaining tokens all duplicate chosen ones (the authors' argmax could pick a
    chosen token again there).

    Requires ``inputs.hidden`` [B, N, D].
    """
    budget = check_budget(inputs, "divprune")
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    return _stack_rows([_divprune_row(features, budget) for features in inputs.hidden])


# --- DART -----------------------------------------------------------------------------------------


def _split_evenly(total: int, parts: int) -> list[int]:
    """``total`` items shared over ``parts`` as evenly as possible, the earlier parts taking the extra."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def _dart_row(features: torch.Tensor, budget: int, pivots: int) -> torch.Tensor:
    """DART on one image's ``features`` [N, D]: ``pivots`` pivots, then the rest least similar to them.

    Returns [K] indices: the pivots (largest L1 norm) followed, pivot by pivot in descending norm
    order, by each pivot's share of the remaining budget, taken as the untaken tokens with the lowest
    cosine similarity to that pivot.
    """
    features = features.float()
    n_pivots = min(pivots, budget)
    norms = features.abs().sum(dim=-1)  # [N] L1 norm
    pivot_index = torch.sort(norms, descending=True, stable=True).indices[:n_pivots]  # [P]
    unit = _unit(features)  # [N, D]
    similarity = unit[pivot_index] @ unit.T  # [P, N]
    taken = torch.zeros(features.shape[0], dtype=torch.bool, device=features.device)  # [N]
    taken[pivot_index] = True
    chosen = [pivot_index]
    for pivot, share in enumerate(_split_evenly(budget - n_pivots, n_pivots)):
        candidates = similarity[pivot].masked_fill(taken, float("inf"))  # [N]
        least_duplicated = torch.sort(candidates, stable=True).indices[:share]  # [share]
        taken[least_duplicated] = True
        chosen.append(least_duplicated)
    return torch.cat(chosen)  # [K]


def dart(inputs: StageInputs, *, pivots: int = 4) -> Selection:
    """DART: keep a few pivot tokens and the tokens least duplicated with them.

    Wen et al., "Stop Looking for Important Tokens in Multimodal Language Models: Duplication Matters
    More", EMNLP 2025 (arXiv 2502.11494); authors' code: github.com/ZichenWen1/DART,
    ``llava/model/language_model/modeling_llama_self.py`` (``get_retained_image_token``) and
    ``scripts/v1_5/eval/*.sh`` (LLaVA-1.5: prune before layer 2, 4 image + 4 text pivots, 128 kept).
    The authors pick pivots by the L1 norm of the scored layer's keys, then, for each pivot in turn,
    add the ``budget // n_pivots`` not yet chosen visual tokens with the lowest cosine similarity to
    it, measured on that layer's final-norm'ed hidden states.

    Here, on ``inputs.hidden`` (the scored layer's output): the ``pivots`` visual tokens of largest
    L1 norm are pivots, and the remaining K - pivots tokens are shared as evenly as possible over
    the pivots (in descending norm order), each pivot taking the untaken tokens least similar to it.

    Deviations, forced by the evidence a selector receives: (1) the pivot norm is taken on the hidden
    states, not on the keys, and similarity on the hidden states without the model's final RMSNorm
    weights; (2) no text pivots (the stage sees only visual tokens), so only the authors' 4 image
    pivots remain and the text pivots' share goes to them; (3) pivots count in the budget, so exactly
    K tokens survive (the authors keep their image pivots on top of the 128; K = 132 matches that
    count); (4) pivots are processed in descending norm order (the authors iterate a Python set).

    Requires ``inputs.hidden`` [B, N, D]. Knob: ``pivots`` (int >= 1).
    """
    budget = check_budget(inputs, "dart")
    pivots = check_int("dart pivots", pivots)
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    return _stack_rows([_dart_row(features, budget, pivots) for features in inputs.hidden])


# --- VisPruner ------------------------------------------------------------------------------------


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
    unit = _unit(features)  # [N, D]
    diverse = _remove_duplicates(unit @ unit.T, residual, n_diverse, step)  # [K - n_important]
    return torch.cat([important, diverse])


def _check_vision_cls(inputs: StageInputs) -> torch.Tensor:
    """Return ``inputs.vision_cls`` [B, N], raising if the vision tower provided none or it is malformed."""
    cls_attention = inputs.vision_cls
    if cls_attention is None:
        raise ValueError(
            "vispruner needs the vision tower's [CLS] attention (inputs.vision_cls); this model's vision "
            "tower has none: use divprune or dart"
        )
    expected = tuple(inputs.hidden.shape[:2])
    if tuple(cls_attention.shape) != expected:
        got = tuple(cls_attention.shape)
        raise ValueError(f"inputs.vision_cls must be [B, N] = {expected} like inputs.hidden, got {got}")
    if torch.isnan(cls_attention).any():
        raise ValueError("inputs.vision_cls contains NaN; cannot rank visual tokens")
    return cls_attention


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
    cls_attention = _check_vision_cls(inputs)
    if isinstance(important_ratio, bool) or not isinstance(important_ratio, int | float):
        raise ValueError(f"vispruner important_ratio must be a number in [0, 1], got {important_ratio!r}")
    if not 0.0 <= important_ratio <= 1.0:
        raise ValueError(f"vispruner important_ratio must be in [0, 1], got {important_ratio!r}")
    step = check_int("vispruner step", step)
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    rows = [
        _vispruner_row(features, attention, budget, important_ratio, step)
        for features, attention in zip(inputs.hidden, cls_attention, strict=True)
    ]
    return _stack_rows(rows)
