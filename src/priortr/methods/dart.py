"""DART (Wen et al., "Stop Looking for Important Tokens in Multimodal Language Models: Duplication Matters
More", EMNLP 2025): keep a few pivot tokens and the tokens least duplicated with them.
"""

from __future__ import annotations

import torch

from priortr.methods.checks import check_budget, check_int
from priortr.methods.registry import register_method
from priortr.methods.tokens import stack_rows, unit
from priortr.selection import Selection, StageInputs, keep_all


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
    units = unit(features)  # [N, D]
    similarity = units[pivot_index] @ units.T  # [P, N]
    taken = torch.zeros(features.shape[0], dtype=torch.bool, device=features.device)  # [N]
    taken[pivot_index] = True
    chosen = [pivot_index]
    for pivot, share in enumerate(_split_evenly(budget - n_pivots, n_pivots)):
        candidates = similarity[pivot].masked_fill(taken, float("inf"))  # [N]
        least_duplicated = torch.sort(candidates, stable=True).indices[:share]  # [share]
        taken[least_duplicated] = True
        chosen.append(least_duplicated)
    return torch.cat(chosen)  # [K]


@register_method(
    "dart",
    where="layer",
    summary="tokens least duplicated with a few pivot tokens, at the scored layer",
    source="DART, Wen et al., EMNLP 2025 (arXiv 2502.11494)",
)
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
    return stack_rows([_dart_row(features, budget, pivots) for features in inputs.hidden])
