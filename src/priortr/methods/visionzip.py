"""VisionZip (Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language Models",
CVPR 2025): dominant tokens by the vision tower's [CLS] attention, the rest merged into contextual
tokens by key similarity, before the LLM.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from priortr.methods.checks import check_budget, check_fraction, check_vision
from priortr.methods.groups import Group, plain_groups, stack_plans, uniform_group
from priortr.methods.registry import register_method
from priortr.methods.tokens import descending
from priortr.selection import Selection, StageInputs, keep_all


def _visionzip_row(cls: torch.Tensor, keys: torch.Tensor, budget: int, n_contextual: int) -> list[Group]:
    """VisionZip on one image: ``cls`` [N], ``keys`` [H, N, d]."""
    order = descending(cls)  # [N]
    n_dominant = budget - n_contextual
    groups = plain_groups(order[:n_dominant])
    if n_contextual == 0:
        return groups
    rest = order[n_dominant:].sort().values  # [R] remaining tokens in sequence order
    metric = F.normalize(keys.mean(dim=0)[rest], dim=-1)  # [R, d] head-mean keys, unit length
    step = max(1, rest.numel() // n_contextual)
    is_target = torch.zeros(rest.numel(), dtype=torch.bool, device=rest.device)  # [R]
    target_pos = torch.arange(0, rest.numel(), step, device=rest.device)[:n_contextual]  # [C]
    is_target[target_pos] = True
    similarity = metric[~is_target] @ metric[target_pos].T  # [R - C, C]
    assignment = torch.argmax(similarity, dim=-1)  # [R - C] first maximum: earliest target
    targets, others = rest[target_pos], rest[~is_target]  # [C], [R - C]
    for position in range(n_contextual):
        members = torch.cat([targets[position : position + 1], others[assignment == position]])
        groups.append(uniform_group(members, int(targets[position])))
    return groups


@register_method(
    "visionzip",
    where="vision",
    needs=("vision",),
    summary="dominant tokens by [CLS] attention plus contextual tokens merged by key similarity",
    source="VisionZip, Yang et al., CVPR 2025",
)
def visionzip(inputs: StageInputs, *, contextual_ratio: float = 10 / 64) -> Selection:
    """VisionZip: keep the tokens the vision tower's [CLS] attends to most, merge the rest by key similarity.

    Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language Models", CVPR 2025
    (arXiv 2412.04467); authors' code: github.com/dvlab-research/VisionZip, ``visionzip/clip_encoder.py``
    and ``visionzip/utils.py``. Dominant tokens: the top (K - C) by [CLS] attention (the authors sum it
    over heads; the head mean ranks identically). Contextual tokens: the remaining R tokens, in sequence
    order, are split into C targets (every ``R // C``-th token, the first C of them) and the others;
    each other token joins the target whose key is most cosine-similar, keys averaged over heads as the
    authors do (``key_states.mean(1)``), and each target becomes the mean hidden state of itself and
    the tokens that joined it, in the target's slot.

    Default split: the authors publish 54 dominant + 10 contextual for 64 tokens (README); 108 + 20 and
    162 + 30, the splits used for 128 and 192 (not checked against the paper's text here), share that
    ratio: C = round(K * ``contextual_ratio``) with ratio 10/64.

    Deviations: (1) the authors also keep the [CLS] token as one of the dominant tokens (``dominant=54``
    keeps [CLS] + 53 patches); the language model here sees only patch tokens, so all K - C dominant
    tokens are patches; (2) the authors' contextual token is target + mean of the joined tokens (weights
    summing to 2), here the mean over target and joined tokens (a convex combination, as the merge
    contract requires); (3) with no token joining a target, the
    target is kept as is, as in the authors' code.

    Requires ``inputs.hidden``, ``inputs.vision_cls`` [B, N] and ``inputs.vision_keys`` [B, H, N, d].
    Knob: ``contextual_ratio`` in [0, 1], the share of K that is contextual tokens.
    """
    budget = check_budget(inputs, "visionzip")
    contextual_ratio = check_fraction("visionzip contextual_ratio", contextual_ratio)
    cls, keys = check_vision(inputs, "visionzip")
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    n_contextual = math.floor(budget * contextual_ratio + 0.5)
    rows = [_visionzip_row(cls[b], keys[b], budget, n_contextual) for b in range(cls.shape[0])]
    return stack_plans(rows, inputs.n_visual)
