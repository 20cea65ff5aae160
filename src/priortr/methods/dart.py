"""DART (Wen et al., "Stop Looking for Important Tokens in Multimodal Language Models: Duplication Matters
More", EMNLP 2025): keep a few pivot tokens and the tokens least duplicated with them.

Authors' code: github.com/ZichenWen1/DART, ``llava/model/language_model/modeling_llama_self.py``
(``LlamaModel.forward``, ``get_retained_image_token``) at 9fee9fa1 (read from the fork
xqy1111111/DART, which carries the authors' history), run by ``scripts/v1_5/eval/*.sh`` with
``--pruned_layer 2 --pivot_image_token 4 --pivot_text_token 4 --max_num_trunction 128``. Before layer
``pruned_layer`` runs, the authors read the previous layer (our default ``layer=1``):

* pivots: the 4 image tokens and the 4 tokens after the image (the instruction) with the largest L1
  norm of that layer's keys (after RoPE, every head side by side);
* for each pivot in the order of a Python set of their positions (``priortr.methods.setorder``), the
  ``max_num_trunction // 8`` image tokens not yet taken (image pivots excluded) with the lowest cosine
  similarity to it, on that layer's output through the model's final norm (RMSNorm with its gain);
* kept: the image pivots and every taken token, 4 + 128 = 132 of 576.
"""

from __future__ import annotations

import torch

from priortr.methods.registry import register_method
from priortr.methods.selection import Selection, StageInputs, keep_all
from priortr.methods.setorder import set_order
from priortr.methods.tokens import unit
from priortr.methods.validate import check_budget, check_int
from priortr.methods.value_checks import value_checks

_EVIDENCE = (
    "keys",
    "text_keys",
    "text_after",
    "prompt_positions",
    "text_prompt_positions",
    "normed",
    "text_normed",
)


def _dart_row(
    keys: torch.Tensor,
    text_keys: torch.Tensor,
    text_after: torch.Tensor,
    positions: torch.Tensor,
    text_positions: torch.Tensor,
    normed: torch.Tensor,
    text_normed: torch.Tensor,
    budget: int,
    image_pivots: int,
    text_pivots: int,
) -> torch.Tensor:
    """DART on one image: ``keys`` [N, F], ``normed`` [N, D], ``positions`` [N] of its visual tokens and
    ``text_*`` [R, ...] of the text rows; returns the [K] kept indices into its N visual tokens.

    The K - image pivots tokens are shared over the pivots in visiting order, the first ones taking one
    more when they do not divide evenly (the authors give each pivot ``max_num_trunction // pivots``).
    """
    n_visual = keys.shape[0]
    n_image = min(image_pivots, budget)
    n_text = min(text_pivots, text_keys.shape[0])
    image_index = keys.float().abs().sum(dim=-1).topk(n_image).indices  # [P_i], largest L1 first
    text_norm = text_keys.float().abs().sum(dim=-1).masked_fill(~text_after, float("-inf"))  # [R]
    text_index = text_norm.topk(n_text).indices  # [P_t]
    pivots = unit(torch.cat([normed[image_index], text_normed[text_index]]))  # [P, D]
    order = set_order(torch.cat([positions[image_index], text_positions[text_index]]))  # [P]
    similarity = pivots.index_select(0, order) @ unit(normed).T  # [P, N], in visiting order
    taken = torch.zeros(n_visual, dtype=torch.bool, device=keys.device).scatter(0, image_index, True)
    chosen = [image_index]
    base, extra = divmod(budget - n_image, n_image + n_text)
    for rank in range(n_image + n_text):
        share = base + (rank < extra)
        if share:
            candidates = similarity[rank].masked_fill(taken, float("inf"))  # [N]
            least_duplicated = candidates.topk(share, largest=False).indices  # [share]
            taken = taken.scatter(0, least_duplicated, True)
            chosen.append(least_duplicated)
    return torch.cat(chosen).sort().values  # [K]


def _check_evidence(inputs: StageInputs, text_pivots: int) -> None:
    """Every field DART reads is there; under value checks, every image has its text pivots."""
    missing = [name for name in _EVIDENCE if getattr(inputs, name) is None]
    if missing:
        raise ValueError(
            f"dart needs the scored layer's keys and final-normed states ({', '.join(missing)} missing); "
            "register it with needs=('keys', 'final_norm')"
        )
    if value_checks() and bool((inputs.text_after.sum(dim=-1) < text_pivots).any()):
        raise ValueError(
            f"dart takes {text_pivots} text pivots from the tokens after the image, but a prompt has fewer; "
            "lower text_pivots or put the instruction after the image"
        )


def _check_knobs(*, image_pivots: int, text_pivots: int) -> None:
    check_int("dart image_pivots", image_pivots)
    check_int("dart text_pivots", text_pivots, minimum=0)


@register_method(
    "dart",
    where="layer",
    needs=("keys", "final_norm"),
    layer=1,
    summary="pivots by key L1 norm (image and text), then the tokens least duplicated with each pivot",
    source="DART, Wen et al., EMNLP 2025 (arXiv 2502.11494)",
    check_knobs=_check_knobs,
)
def dart(inputs: StageInputs, *, image_pivots: int = 4, text_pivots: int = 4) -> Selection:
    """DART at the authors' published setting (module docstring): ``image_pivots`` image and
    ``text_pivots`` text pivots by the L1 norm of the scored layer's keys, each pivot in turn taking
    its share of the K - ``image_pivots`` remaining tokens, the least cosine-similar to it on the
    final-normed states. Kept: exactly K = ``budget`` tokens, the image pivots included, so the
    authors' ``max_num_trunction 128`` is K = 132.

    Requires the ``keys`` and ``final_norm`` evidence. Knobs: ``image_pivots`` (int >= 1),
    ``text_pivots`` (int >= 0).
    """
    budget = check_budget(inputs, "dart")
    _check_knobs(image_pivots=image_pivots, text_pivots=text_pivots)
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    _check_evidence(inputs, text_pivots)
    fields = zip(*(getattr(inputs, name) for name in _EVIDENCE), strict=True)
    rows = [_dart_row(*row, budget, image_pivots, text_pivots) for row in fields]
    return Selection(indices=torch.stack(rows))
