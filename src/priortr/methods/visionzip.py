"""VisionZip (Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language Models",
CVPR 2025): dominant tokens by the vision tower's [CLS] attention, the rest merged into contextual
tokens by key similarity, before the LLM.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from priortr.methods.registry import register_method
from priortr.methods.selection import Selection, StageInputs, keep_all
from priortr.methods.tokens import descending, stack_rows, untaken
from priortr.methods.validate import check_bool, check_budget, check_features, check_fraction, check_vision


def _visionzip_row(
    cls: torch.Tensor, keys: torch.Tensor, n_dominant: int, n_contextual: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's kept tokens [K'] (ascending) and merge rows [K', N] over its features, from the
    [CLS] attention ``cls`` [N] and the head-mean keys ``keys`` [N, d]."""
    n_visual = cls.numel()
    dominant = descending(cls)[:n_dominant]
    taken = torch.zeros(n_visual, dtype=torch.bool, device=cls.device)  # [N]
    taken[dominant] = True
    rest = untaken(taken, n_visual - n_dominant)  # [R] ascending, as the authors' boolean mask keeps them
    merge = torch.zeros(n_dominant + n_contextual, n_visual, dtype=keys.dtype, device=cls.device)
    merge[torch.arange(n_dominant, device=cls.device), dominant] = 1.0
    kept = dominant
    if n_contextual > 0:
        metric = F.normalize(keys[rest], dim=-1)  # [R, d]
        step = max(1, rest.numel() // n_contextual)
        target_pos = torch.arange(0, rest.numel(), step, device=cls.device)[:n_contextual]  # [C]
        is_target = torch.zeros(rest.numel(), dtype=torch.bool, device=cls.device)  # [R]
        is_target[target_pos] = True
        others = untaken(is_target, rest.numel() - n_contextual)  # [R - C] ascending
        assignment = torch.argmax(metric[others] @ metric[target_pos].T, dim=-1)  # [R - C] first max
        joined = torch.zeros(n_contextual, dtype=torch.long, device=cls.device)  # [C] tokens joining each
        joined = joined.scatter_add(0, assignment, torch.ones_like(assignment)).clamp(min=1).to(keys.dtype)
        rows = n_dominant + torch.arange(n_contextual, device=cls.device)  # [C]
        merge[rows, rest[target_pos]] = 1.0  # the target itself, plus the mean of the tokens that joined it
        merge[rows[assignment], rest[others]] = 1.0 / joined[assignment]
        kept = torch.cat([dominant, rest[target_pos]])
    order = kept.argsort()
    return kept[order], merge[order]


def _check_knobs(*, contextual_ratio: float, cls_takes_a_slot: bool) -> None:
    check_fraction("visionzip contextual_ratio", contextual_ratio)
    check_bool("visionzip cls_takes_a_slot", cls_takes_a_slot)


def _kept(budget: int, n_visual: int, *, contextual_ratio: float, cls_takes_a_slot: bool) -> int:
    """The visual tokens VisionZip keeps of ``n_visual`` at a budget of ``budget`` < ``n_visual``: one
    fewer when [CLS] takes a slot of the authors' K (``MethodInfo.keeps``; 0: the method refuses it)."""
    return budget - int(cls_takes_a_slot)


@register_method(
    "visionzip",
    where="vision",
    needs=("vision", "features"),
    summary="dominant tokens by [CLS] attention plus contextual tokens merged by key similarity",
    source="VisionZip, Yang et al., CVPR 2025",
    check_knobs=_check_knobs,
    keeps=_kept,
)
def visionzip(
    inputs: StageInputs, *, contextual_ratio: float = 10 / 64, cls_takes_a_slot: bool = True
) -> Selection:
    """VisionZip: keep the tokens the vision tower's [CLS] attends to most, merge the rest by key similarity.

    Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language Models", CVPR 2025
    (arXiv 2412.04467); authors' code: github.com/dvlab-research/VisionZip at
    3151f6df4fca36a4cd1c985e5956e725b1f9ad02, ``visionzip/clip_encoder.py`` (the selection and merge),
    ``visionzip/utils.py`` (keys: ``raw_key_states.mean(1)`` kept at layer 22 of 24, the feature layer)
    and ``visionzip/main.py`` (``dominant_num = dominant - 1``). Dominant tokens: [CLS] and the top
    ``dominant - 1`` patches by the feature layer's [CLS] attention (``attentions[-2]``, summed over
    heads; the head mean ranks alike). Contextual tokens: the remaining R patches, in sequence order,
    are split into C targets (every ``R // C``-th, the first C of them) and the others; each other
    patch joins the target whose key (heads averaged) is most cosine-similar, and a contextual token is
    ``target + mean(joined)`` (the target alone when none joined), formed on the features before the
    projector (``merge_space='features'``), which the projector then maps.

    Budget: K = dominant + contextual as the authors count them (README: ``dominant=54, contextual=10``
    for 64; 108 + 20 and 162 + 30 in llmc's port, ModelTC/LightCompress); C = round(K *
    ``contextual_ratio``), 10/64 (5, 10, 20, 30 for K = 32, 64, 128, 192). The
    authors' K includes [CLS], for which the language model here has no slot: with
    ``cls_takes_a_slot=True`` (default, the authors' patch set) K - C - 1 dominant patches are kept,
    K - 1 visual tokens in all; ``False`` keeps K - C dominant patches (K tokens, the same count as
    every other method).

    Deviations: kept tokens stay in prompt order at their own positions (harness rule; the authors'
    sequence is [CLS], the dominant patches, then the contextual tokens); sorts are stable (ties only).

    Requires ``inputs.vision_cls`` [B, N], ``inputs.vision_keys`` [B, H, N, d] and
    ``inputs.vision_features`` [B, N, C]. Knobs: ``contextual_ratio`` in [0, 1], ``cls_takes_a_slot``.
    """
    budget = check_budget(inputs, "visionzip")
    _check_knobs(contextual_ratio=contextual_ratio, cls_takes_a_slot=cls_takes_a_slot)
    cls, keys = check_vision(inputs, "visionzip")
    check_features(inputs, "visionzip")
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    n_contextual = math.floor(budget * contextual_ratio + 0.5)
    n_dominant = budget - n_contextual - int(cls_takes_a_slot)
    if n_dominant + n_contextual < 1:
        raise ValueError(f"visionzip: a budget of {budget} leaves no patch once [CLS] takes its slot")
    if n_contextual == 0:  # plain pruning: the survivors keep their own embeddings
        return stack_rows([descending(cls[b])[:n_dominant] for b in range(cls.shape[0])])
    rows = [
        _visionzip_row(cls[b], keys[b].mean(dim=0), n_dominant, n_contextual) for b in range(cls.shape[0])
    ]
    return Selection(
        indices=torch.stack([kept for kept, _ in rows]),
        merge=torch.stack([merge for _, merge in rows]),
        merge_space="features",
    )
