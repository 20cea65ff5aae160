"""Token scoring and top-K selection for prior-corrected visual token reduction.

Pure tensor functions, independent of any model library. The flow follows the paper
(§3.4 "Prior-Corrected Token Reduction Procedure" and Appendix "PriorTR Implementation Details"):

1. :func:`build_evidence` turns the raw attention at the pruning layer into three distributions over
   the N visual tokens: the prior Q (separator row), the posterior P (instruction rows) and the
   last-prompt-token row used by FastV.
2. A scoring rule (``priortr.methods``, e.g. ``methods/priortr.py`` for Eq. (8)) maps that evidence to
   per-token scores.
3. :func:`select_top_k` turns the scores into the indices that are kept (the budget is a count by then:
   ``priortr.engine.config.resolve_budget``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from priortr.methods.value_checks import value_checks

EPS: float = 1e-6
"""Smoothing constant of the PriorTR score, ε = 1e-6 (Appendix, "Computing Scores")."""

HEAD_AGGREGATIONS = ("mean", "max")
"""How attention is aggregated over heads (``aggregate_heads``)."""


@dataclass(frozen=True)
class Evidence:
    """Per-image attention evidence at the scoring layer, float32, each row L1-normalised over visual tokens.

    ``prior`` is Q (Eq. (3)), the separator token's row; ``posterior`` is P (Eq. (2)), the mean over
    instruction rows; ``last`` is the last prompt token's row, FastV's ranking signal. ``seed`` feeds
    the ``random`` baseline rule so that it is reproducible.
    """

    prior: torch.Tensor  # [B, N]  Q: separator row
    posterior: torch.Tensor  # [B, N]  P: mean over instruction rows
    last: torch.Tensor  # [B, N]  attention of the last prompt token (FastV's signal)
    seed: int = 0  # for the `random` rule

    def __post_init__(self) -> None:
        """Reject evidence whose tensors disagree in shape or are not float32 [B, N]."""
        fields = {"prior": self.prior, "posterior": self.posterior, "last": self.last}
        for name, tensor in fields.items():
            if tensor.ndim != 2:
                raise ValueError(f"Evidence.{name} must be [B, N], got shape {tuple(tensor.shape)}")
            if tensor.dtype != torch.float32:
                raise ValueError(f"Evidence.{name} must be float32, got {tensor.dtype}")
        shapes = {name: tuple(tensor.shape) for name, tensor in fields.items()}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"Evidence tensors must share one shape [B, N], got {shapes}")


def aggregate_heads(attn: torch.Tensor, how: str = "mean") -> torch.Tensor:
    """Collapse the head axis (second to last) of attention weights: ``[..., H, N] -> [..., N]``.

    The paper aggregates attention across heads before normalising (Appendix, Agg_h); ``mean`` is the
    default and ``max`` keeps a token that any single head attends to strongly.
    """
    if how == "mean":
        return attn.mean(dim=-2)
    if how == "max":
        return attn.amax(dim=-2)
    raise ValueError(f"unknown head aggregation {how!r}; options: {', '.join(HEAD_AGGREGATIONS)}")


NO_WEIGHT_FIX = (
    "the attention they come from gives the visual tokens no weight (at a sliding-window layer, a row "
    "farther from the image than the window sees none of it); score a layer that attends to the image "
    "(layer=, a global-attention layer on models with local ones) or use another method"
)
"""What a row without attention on the image means, and what to change (strict=True errors, warnings)."""


def l1_normalise(x: torch.Tensor) -> torch.Tensor:
    """Divide each row (last dim) by its sum, returning float32 categorical distributions.

    Raw attention over the visual tokens does not sum to one (the rest goes to text tokens), so P and Q
    are L1-normalised to be comparable (Appendix, "Computing Scores"). A row with no positive finite
    mass carries no ranking information; it raises instead of silently becoming uniform.
    """
    x = x.float()
    total = x.sum(dim=-1, keepdim=True)  # [..., 1]
    if value_checks():
        bad = ~(torch.isfinite(total) & (total > 0))
        if bad.any():
            raise ValueError(
                f"cannot L1-normalise {int(bad.sum())} row(s) whose sum is zero, negative or not finite: "
                + NO_WEIGHT_FIX
            )
    return x / total


def _masked_row_mean(rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Average ``rows`` [B, R, N] over the rows flagged in ``valid`` [B, R], ignoring the others entirely.

    ``torch.where`` (not multiplication by the mask) keeps inf/NaN in invalid rows, e.g. padding, out of
    the result.
    """
    kept = torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype))  # [B, R, N]
    count = valid.sum(dim=-1, keepdim=True).to(rows.dtype)  # [B, 1]
    return kept.sum(dim=-2) / count  # [B, N]


def _check_evidence_inputs(
    prior_attn: torch.Tensor,
    posterior_attn: torch.Tensor,
    posterior_valid: torch.Tensor,
    last_attn: torch.Tensor,
) -> None:
    """Validate the shapes of :func:`build_evidence`'s inputs and that every image has an instruction row."""
    if prior_attn.ndim != 3:
        raise ValueError(f"prior_attn must be [B, H, N], got shape {tuple(prior_attn.shape)}")
    batch, heads, n_visual = prior_attn.shape
    if tuple(last_attn.shape) != (batch, heads, n_visual):
        raise ValueError(
            f"last_attn must be [B, H, N] = {(batch, heads, n_visual)}, got {tuple(last_attn.shape)}"
        )
    if posterior_attn.ndim != 4 or tuple(posterior_attn.shape[:2]) != (batch, heads):
        raise ValueError(
            f"posterior_attn must be [B, H, R, N] with B, H = {(batch, heads)}, "
            f"got {tuple(posterior_attn.shape)}"
        )
    if posterior_attn.shape[-1] != n_visual:
        raise ValueError(
            f"posterior_attn has {posterior_attn.shape[-1]} visual tokens, prior_attn has {n_visual}"
        )
    n_rows = posterior_attn.shape[2]
    if posterior_valid.dtype != torch.bool or tuple(posterior_valid.shape) != (batch, n_rows):
        raise ValueError(
            f"posterior_valid must be a bool tensor [B, R] = {(batch, n_rows)}, "
            f"got {posterior_valid.dtype} {tuple(posterior_valid.shape)}"
        )
    check_posterior_rows(posterior_valid)


def check_posterior_rows(posterior_valid: torch.Tensor) -> None:
    """Refuse, when value checks are on, an image none of whose R rows ``posterior_valid`` [B, R] flags."""
    if not value_checks():
        return
    empty = ~posterior_valid.any(dim=-1)  # [B]
    if empty.any():
        raise ValueError(f"images {empty.nonzero().flatten().tolist()} have no valid instruction row")


def build_evidence(
    prior_attn: torch.Tensor,
    posterior_attn: torch.Tensor,
    posterior_valid: torch.Tensor,
    last_attn: torch.Tensor,
    heads: str = "mean",
    seed: int = 0,
) -> Evidence:
    """Turn layer-L attention over the visual tokens into normalised prior, posterior and FastV rows.

    Following the Appendix ("Extracting Q and P"): Q is the separator token's row, P averages the rows of
    the instruction tokens, and both are aggregated over heads and L1-normalised. ``posterior_valid``
    marks which of the R instruction rows belong to each image, so images with prompts of different
    length can share one padded tensor.

    Args:
        prior_attn: [B, H, N] separator row.
        posterior_attn: [B, H, R, N] instruction rows.
        posterior_valid: bool [B, R]; each image needs at least one True.
        last_attn: [B, H, N] last prompt token row.
        heads: head aggregation, see :func:`aggregate_heads`.
        seed: seed for the ``random`` rule.
    """
    _check_evidence_inputs(prior_attn, posterior_attn, posterior_valid, last_attn)
    # Cast before any arithmetic: the model may run in fp16/bf16, whose sums lose precision.
    prior_attn, posterior_attn, last_attn = prior_attn.float(), posterior_attn.float(), last_attn.float()
    rows = aggregate_heads(posterior_attn.transpose(1, 2), heads)  # [B, R, N]
    posterior = _masked_row_mean(rows, posterior_valid)  # [B, N]
    return reduced_evidence(prior_attn, posterior, last_attn, heads=heads, seed=seed)


def reduced_evidence(
    prior_attn: torch.Tensor,
    posterior: torch.Tensor,
    last_attn: torch.Tensor,
    heads: str = "mean",
    seed: int = 0,
) -> Evidence:
    """``build_evidence`` from a posterior already reduced over heads and rows: prior and last rows
    [B, H, N], aggregated over heads here, and the posterior [B, N] (the mean over the instruction
    rows of each row's head aggregate), each L1-normalised in float32.

    A caller that reduces the instruction rows a chunk at a time (``priortr.engine.evidence``, whose
    memory must not grow with R) hands its running result here."""
    prior = aggregate_heads(prior_attn.float(), heads)  # [B, N]
    last = aggregate_heads(last_attn.float(), heads)  # [B, N]
    return Evidence(
        prior=l1_normalise(prior),
        posterior=l1_normalise(posterior),
        last=l1_normalise(last),
        seed=seed,
    )


def select_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the K highest scores per row, returned in ascending (original sequence) order.

    A stable descending sort makes ties deterministic: among equal scores the lower index wins.
    Ascending output keeps the retained visual tokens in their original positional order.

    Args:
        scores: [B, N], higher = keep; NaN is rejected.
        k: number kept per row, 1 <= k <= N.

    Returns:
        LongTensor [B, k].
    """
    if scores.ndim != 2:
        raise ValueError(f"scores must be [B, N], got shape {tuple(scores.shape)}")
    n_visual = scores.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_visual:
        raise ValueError(f"k must be an int with 1 <= k <= N = {n_visual}, got {k!r}")
    if value_checks() and torch.isnan(scores).any():
        raise ValueError(f"scores contain NaN; cannot rank visual tokens: {NO_WEIGHT_FIX}")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # [B, N]
    return order[:, :k].sort(dim=-1).values  # [B, k]
