"""DivPrune (Alvar et al., "DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models",
CVPR 2025): keep the visual tokens that greedily solve the max-min diversity problem, before the LLM.
"""

from __future__ import annotations

import torch

from priortr.methods.registry import register_method
from priortr.methods.selection import Selection, StageInputs, keep_all
from priortr.methods.tokens import stack_rows, unit
from priortr.methods.validate import check_budget


def _divprune_row(features: torch.Tensor, budget: int) -> torch.Tensor:
    """Greedy max-min diversity subset of ``budget`` rows of ``features`` [N, D]; returns [K] indices.

    The first token is the one whose nearest other token is farthest; each next token maximises its
    distance to the nearest token already chosen. Distance is 1 - cosine similarity.
    """
    units = unit(features)  # [N, D]
    distance = 1.0 - units @ units.T  # [N, N]
    n_visual = distance.shape[0]
    self_pairs = torch.eye(n_visual, dtype=torch.bool, device=distance.device)  # [N, N]
    score = distance.masked_fill(self_pairs, float("inf")).amin(dim=-1)  # [N] nearest-other distance
    nearest_chosen = torch.full_like(score, float("inf"))  # [N]
    taken = torch.zeros(n_visual, dtype=torch.bool, device=distance.device)  # [N]
    chosen = []
    for _ in range(budget):
        index = torch.argmax(score.masked_fill(taken, float("-inf"))).reshape(1)  # first maximum: lowest
        chosen.append(index)
        taken = taken.index_fill(0, index, True)  # by a tensor index, no host read (compiles in one graph)
        nearest_chosen = torch.minimum(nearest_chosen, distance.index_select(0, index)[0])
        score = nearest_chosen
    return torch.cat(chosen)  # [K]


@register_method(
    "divprune",
    where="vision",
    summary="max-min diversity over the visual tokens' embeddings",
    source="DivPrune, Alvar et al., CVPR 2025",
)
def divprune(inputs: StageInputs) -> Selection:
    """DivPrune: keep the K visual tokens that greedily solve the max-min diversity problem.

    Alvar et al., "DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models",
    CVPR 2025 (arXiv 2503.02175); authors' code: github.com/vbdi/divprune at
    799e2d950aa01ba7860907f5a6d86061f885dca6, ``LLaVA/llava/model/llava_arch.py`` (``DivPrune``;
    ``SUBSET_RATIO=0.098`` published, K = round(ratio x N)); ``tests/methods/test_official_divprune.py``.
    Pruning before the language model (their ``LAYER_INDEX=0``), on the LLM input embeddings of the
    visual tokens, i.e. ``inputs.hidden`` of a vision stage. Distance d(i, j) = 1 - cos(h_i, h_j).
    The first token maximises the distance to its nearest other token; each further token maximises
    the minimum distance to the tokens already chosen (greedy MMDP). The authors' only knob is the
    kept ratio, here the budget K.

    Deviation: tokens already chosen are excluded from later picks, so K distinct tokens are kept
    even when the remaining tokens all duplicate chosen ones (the authors' argmax can then pick a
    chosen token again, its own distance being a rounding error above the duplicates' 0, and their
    ``new_input_embeds[:, keep_indexs]`` repeats it in the sequence). Identical picks otherwise.

    Requires ``inputs.hidden`` [B, N, D].
    """
    budget = check_budget(inputs, "divprune")
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    return stack_rows([_divprune_row(features, budget) for features in inputs.hidden])
