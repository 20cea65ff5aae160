"""The paper's scoring-function ablations (Sec. 4.3) and a seeded random control, each a top-K rule.

They read the same evidence as PriorTR (Q, the separator row; P, the instruction rows; Eq. (2)-(3))
and differ only in how they combine it, so a comparison isolates the scoring function.
"""

from __future__ import annotations

import torch

from priortr.methods.registry import register_rule
from priortr.methods.scoring import EPS, Evidence


@register_rule(
    "prior", summary="Q: separator-token attention (model-induced prior)", source="PriorTR, Eq. (3)"
)
def score_prior(evidence: Evidence) -> torch.Tensor:
    """Rank by the instruction-agnostic prior alone (Sec. 4.3 scoring-function ablation)."""
    return evidence.prior


@register_rule(
    "posterior", summary="P: instruction-token attention (raw attention ranking)", source="PriorTR, Eq. (2)"
)
def score_posterior(evidence: Evidence) -> torch.Tensor:
    """Rank by the posterior magnitude, the baseline score that prior-dominated masking affects."""
    return evidence.posterior


@register_rule(
    "diff", summary="P - Q: posterior minus prior", source="PriorTR, Sec. 4.3 scoring-function ablation"
)
def score_diff(evidence: Evidence) -> torch.Tensor:
    """Subtract the prior baseline from the posterior (ablation)."""
    return evidence.posterior - evidence.prior


@register_rule(
    "logratio",
    summary="log((P + eps) / (Q + eps)): pointwise lift only",
    source="PriorTR, Eq. (6) (PVI); Sec. 4.3 scoring-function ablation",
)
def score_logratio(evidence: Evidence) -> torch.Tensor:
    """Rank by the pointwise V-information (semantic lift) without the posterior weight (ablation)."""
    p, q = evidence.posterior, evidence.prior  # [B, N]
    return torch.log((p + EPS) / (q + EPS))


@register_rule(
    "entropy", summary="P log P - Q log Q (0 log 0 = 0)", source="PriorTR, Sec. 4.3 scoring-function ablation"
)
def score_entropy(evidence: Evidence) -> torch.Tensor:
    """Difference of per-token entropy terms (ablation); ``xlogy`` makes a zero mass contribute zero."""
    p, q = evidence.posterior, evidence.prior  # [B, N]
    return torch.xlogy(p, p) - torch.xlogy(q, q)


@register_rule(
    "random",
    summary="uniform random scores from a generator seeded with evidence.seed",
    source="random-pruning baseline (control)",
)
def score_random(evidence: Evidence) -> torch.Tensor:
    """Seeded uniform scores: reproducible for a seed and blind to the attention values. Every image
    gets the same draw, so a row's choice does not depend on the batch it runs in."""
    generator = torch.Generator().manual_seed(evidence.seed)
    scores = torch.rand(evidence.prior.shape[-1], generator=generator, dtype=torch.float32)  # [N]
    return scores.to(evidence.prior.device).expand_as(evidence.prior)
