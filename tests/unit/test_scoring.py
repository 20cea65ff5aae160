"""Tests for priortr.methods.scoring and the scoring rules of priortr.methods: evidence, rules, budgets,
top-K."""

from __future__ import annotations

import math

import pytest
import torch

from priortr.engine.config import resolve_budget
from priortr.methods import available_rules, get_rule, register_rule
from priortr.methods.scoring import (
    EPS,
    Evidence,
    aggregate_heads,
    build_evidence,
    l1_normalise,
    select_top_k,
)

RULE_NAMES = ["diff", "entropy", "fastv", "logratio", "posterior", "prior", "priortr", "random"]

# Two images, three visual tokens; rows are already L1-normalised. Row 0 has a zero posterior mass.
P_ROWS = [[0.5, 0.5, 0.0], [0.1, 0.6, 0.3]]
Q_ROWS = [[0.25, 0.25, 0.5], [0.3, 0.3, 0.4]]
LAST_ROWS = [[0.2, 0.7, 0.1], [0.6, 0.1, 0.3]]


def _evidence(seed: int = 0) -> Evidence:
    return Evidence(
        prior=torch.tensor(Q_ROWS),
        posterior=torch.tensor(P_ROWS),
        last=torch.tensor(LAST_ROWS),
        seed=seed,
    )


def _xlogx(x: float) -> float:
    return 0.0 if x == 0.0 else x * math.log(x)


# Scalar reference formulas written independently of the module, evaluated in float64 with math.log.
HAND_FORMULAS = {
    "priortr": lambda p, q, last: p * math.log((p + 1e-6) / (q + 1e-6)),
    "prior": lambda p, q, last: q,
    "posterior": lambda p, q, last: p,
    "diff": lambda p, q, last: p - q,
    "logratio": lambda p, q, last: math.log((p + 1e-6) / (q + 1e-6)),
    "entropy": lambda p, q, last: _xlogx(p) - _xlogx(q),
    "fastv": lambda p, q, last: last,
}


# --- registry -------------------------------------------------------------------------------------


def test_available_rules_is_sorted_and_complete() -> None:
    assert available_rules() == RULE_NAMES


def test_rule_info_carries_name_summary_and_source() -> None:
    for name in RULE_NAMES:
        info = get_rule(name)
        assert info.name == name
        assert info.summary
        assert info.source
    assert "PriorTR" in get_rule("priortr").source
    assert "FastV" in get_rule("fastv").source


def test_get_rule_unknown_lists_available() -> None:
    with pytest.raises(ValueError, match="unknown scoring rule 'nope'; available: diff, entropy, fastv"):
        get_rule("nope")


def test_register_rule_duplicate_raises_and_keeps_original() -> None:
    original = get_rule("priortr").rule
    with pytest.raises(ValueError, match="priortr"):

        @register_rule("priortr", summary="dup", source="dup")
        def _dup(evidence: Evidence) -> torch.Tensor:
            return evidence.prior

    assert get_rule("priortr").rule is original


def test_eps_matches_paper() -> None:
    assert EPS == 1e-6


# --- rules ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(HAND_FORMULAS))
def test_rule_matches_hand_computed_values(name: str) -> None:
    formula = HAND_FORMULAS[name]
    expected = [
        [formula(p, q, last) for p, q, last in zip(p_row, q_row, last_row, strict=True)]
        for p_row, q_row, last_row in zip(P_ROWS, Q_ROWS, LAST_ROWS, strict=True)
    ]
    scores = get_rule(name).rule(_evidence())
    assert scores.dtype == torch.float32
    assert scores.shape == (2, 3)
    for got_row, want_row in zip(scores.tolist(), expected, strict=True):
        assert got_row == pytest.approx(want_row, rel=1e-5, abs=1e-7)


def test_priortr_hand_values_spelled_out() -> None:
    scores = get_rule("priortr").rule(_evidence())
    # 0.5 * ln((0.5 + 1e-6) / (0.25 + 1e-6)) ≈ 0.5 * ln 2; a zero posterior contributes exactly zero.
    assert scores[0, 0].item() == pytest.approx(0.5 * math.log(0.500001 / 0.250001), rel=1e-6)
    assert scores[0, 2].item() == 0.0
    assert scores[1, 0].item() == pytest.approx(0.1 * math.log(0.100001 / 0.300001), rel=1e-5)


def test_entropy_treats_zero_log_zero_as_zero() -> None:
    scores = get_rule("entropy").rule(_evidence())
    assert torch.isfinite(scores).all()
    # P = 0, Q = 0.5: 0 - 0.5 ln 0.5
    assert scores[0, 2].item() == pytest.approx(-0.5 * math.log(0.5), rel=1e-6)


@pytest.mark.parametrize("name", RULE_NAMES)
def test_every_rule_returns_float32_batch_by_tokens(name: str) -> None:
    scores = get_rule(name).rule(_evidence())
    assert scores.dtype == torch.float32
    assert scores.shape == (2, 3)


def test_random_rule_is_deterministic_per_seed() -> None:
    rule = get_rule("random").rule
    first = rule(_evidence(seed=7))
    assert torch.equal(first, rule(_evidence(seed=7)))
    assert not torch.equal(first, rule(_evidence(seed=8)))
    assert ((first >= 0) & (first < 1)).all()


def test_random_rule_ignores_evidence_values() -> None:
    rule = get_rule("random").rule
    other = Evidence(
        prior=torch.full((2, 3), 1 / 3),
        posterior=torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]),
        last=torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]),
        seed=3,
    )
    assert torch.equal(rule(_evidence(seed=3)), rule(other))


def test_motivating_case_priortr_keeps_target_posterior_keeps_background() -> None:
    # Token 0: background with a large prior and the largest posterior (lift 0.5 / 0.6 < 1).
    # Token 1: target with a small prior and a large lift (0.3 / 0.05 = 6). Others are filler.
    q = [0.60, 0.05, 0.20, 0.15]
    p = [0.50, 0.30, 0.10, 0.10]
    # Eq. (5) masking condition holds: L_tgt / L_bg < Q_bg / Q_tgt.
    assert (p[1] / q[1]) / (p[0] / q[0]) < q[0] / q[1]
    evidence = build_evidence(
        prior_attn=torch.tensor([[q]]),  # [1, 1, 4]
        posterior_attn=torch.tensor([[[p]]]),  # [1, 1, 1, 4]
        posterior_valid=torch.tensor([[True]]),
        last_attn=torch.tensor([[p]]),
    )
    assert select_top_k(get_rule("posterior").rule(evidence), 1).tolist() == [[0]]
    assert select_top_k(get_rule("priortr").rule(evidence), 1).tolist() == [[1]]


# --- evidence -------------------------------------------------------------------------------------


def test_aggregate_heads_mean_and_max() -> None:
    attn = torch.tensor([[0.6, 0.3, 0.1], [0.0, 0.2, 0.8]])  # [H=2, N=3]
    assert aggregate_heads(attn, "mean").tolist() == pytest.approx([0.3, 0.25, 0.45])
    assert aggregate_heads(attn, "max").tolist() == pytest.approx([0.6, 0.3, 0.8])
    assert aggregate_heads(attn).tolist() == pytest.approx([0.3, 0.25, 0.45])


def test_aggregate_heads_uses_second_to_last_axis() -> None:
    attn = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 9.0]]])  # [B=1, H=3, N=2]
    assert aggregate_heads(attn, "mean").tolist()[0] == pytest.approx([3.0, 5.0])
    assert aggregate_heads(attn, "max").tolist() == [[5.0, 9.0]]


def test_aggregate_heads_unknown_option_names_choices() -> None:
    with pytest.raises(ValueError, match="mean, max"):
        aggregate_heads(torch.ones(2, 3), "median")


def test_l1_normalise_rows_sum_to_one_and_float32() -> None:
    x = torch.tensor([[1.0, 3.0], [2.0, 2.0]], dtype=torch.float16)
    out = l1_normalise(x)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.25, 0.75], [0.5, 0.5]]


def test_l1_normalise_zero_row_raises() -> None:
    with pytest.raises(ValueError, match="1 row"):
        l1_normalise(torch.tensor([[0.0, 0.0], [1.0, 1.0]]))


def test_build_evidence_normalises_each_signal() -> None:
    evidence = build_evidence(
        prior_attn=torch.tensor([[[0.2, 0.2, 0.1]]]),  # [1, 1, 3]
        posterior_attn=torch.tensor([[[[0.1, 0.3, 0.1]]]]),  # [1, 1, 1, 3]
        posterior_valid=torch.tensor([[True]]),
        last_attn=torch.tensor([[[0.0, 0.05, 0.15]]]),
        seed=5,
    )
    assert evidence.prior.tolist()[0] == pytest.approx([0.4, 0.4, 0.2])
    assert evidence.posterior.tolist()[0] == pytest.approx([0.2, 0.6, 0.2])
    assert evidence.last.tolist()[0] == pytest.approx([0.0, 0.25, 0.75])
    assert evidence.seed == 5
    for tensor in (evidence.prior, evidence.posterior, evidence.last):
        assert tensor.dtype == torch.float32


def _posterior_case(invalid_row: list[float], valid_third: bool = False) -> torch.Tensor:
    posterior_attn = torch.tensor([[[[1.0, 2.0, 1.0], [3.0, 2.0, 1.0], invalid_row]]])  # [1, 1, 3, 3]
    return build_evidence(
        prior_attn=torch.ones(1, 1, 3),
        posterior_attn=posterior_attn,
        posterior_valid=torch.tensor([[True, True, valid_third]]),
        last_attn=torch.ones(1, 1, 3),
    ).posterior


def test_posterior_averages_only_valid_rows() -> None:
    # Mean of the valid rows is [2, 2, 1] -> normalised [0.4, 0.4, 0.2].
    assert _posterior_case([1000.0, 0.0, 0.0]).tolist()[0] == pytest.approx([0.4, 0.4, 0.2])


def test_invalid_row_does_not_change_posterior_negative_control() -> None:
    baseline = _posterior_case([0.0, 0.0, 0.0])
    assert torch.equal(_posterior_case([1000.0, 0.0, 0.0]), baseline)
    assert torch.equal(_posterior_case([float("inf"), float("nan"), 0.0]), baseline)
    # Control: the same huge row, once counted, does move P, so the test above can detect a leak.
    assert not torch.allclose(_posterior_case([1000.0, 0.0, 0.0], valid_third=True), baseline)


def test_posterior_validity_is_per_image() -> None:
    posterior_attn = torch.tensor(
        [
            [[[1.0, 0.0], [0.0, 1.0]]],  # image 0: both rows valid -> [0.5, 0.5]
            [[[1.0, 3.0], [9.0, 0.0]]],  # image 1: only row 0 valid -> [0.25, 0.75]
        ]
    )  # [2, 1, 2, 2]
    evidence = build_evidence(
        prior_attn=torch.ones(2, 1, 2),
        posterior_attn=posterior_attn,
        posterior_valid=torch.tensor([[True, True], [True, False]]),
        last_attn=torch.ones(2, 1, 2),
    )
    assert evidence.posterior.tolist() == [[0.5, 0.5], [0.25, 0.75]]


def test_build_evidence_head_max_vs_mean() -> None:
    prior_attn = torch.tensor([[[0.6, 0.3, 0.1], [0.0, 0.2, 0.8]]])  # [1, H=2, 3]
    # Two instruction rows per head: [B=1, H=2, R=2, N=3].
    posterior_attn = torch.tensor([[[[0.4, 0.0, 0.0], [0.0, 0.2, 0.0]], [[0.0, 0.0, 0.2], [0.0, 0.6, 0.0]]]])
    kwargs = {
        "prior_attn": prior_attn,
        "posterior_attn": posterior_attn,
        "posterior_valid": torch.tensor([[True, True]]),
        "last_attn": prior_attn,
    }
    mean = build_evidence(**kwargs, heads="mean")
    high = build_evidence(**kwargs, heads="max")
    # mean over heads: prior [0.3, 0.25, 0.45] (sum 1); max: [0.6, 0.3, 0.8] / 1.7.
    assert mean.prior.tolist()[0] == pytest.approx([0.3, 0.25, 0.45])
    assert high.prior.tolist()[0] == pytest.approx([0.6 / 1.7, 0.3 / 1.7, 0.8 / 1.7])
    # Posterior, heads first then rows. mean: row0 [0.2, 0, 0.1], row1 [0, 0.4, 0] -> [0.1, 0.2, 0.05] / 0.35.
    assert mean.posterior.tolist()[0] == pytest.approx([0.1 / 0.35, 0.2 / 0.35, 0.05 / 0.35])
    # max: row0 [0.4, 0, 0.2], row1 [0, 0.6, 0] -> [0.2, 0.3, 0.1] / 0.6.
    assert high.posterior.tolist()[0] == pytest.approx([0.2 / 0.6, 0.3 / 0.6, 0.1 / 0.6])


def test_build_evidence_rejects_unknown_heads() -> None:
    with pytest.raises(ValueError, match="mean, max"):
        build_evidence(
            torch.ones(1, 1, 2), torch.ones(1, 1, 1, 2), torch.tensor([[True]]), torch.ones(1, 1, 2), "sum"
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_attention_matches_float32_of_rounded_values(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    n_visual, heads, rows = 576, 32, 7
    prior = torch.rand(2, heads, n_visual, generator=generator).mul(0.01).to(dtype)
    posterior = torch.rand(2, heads, rows, n_visual, generator=generator).mul(0.01).to(dtype)
    last = torch.rand(2, heads, n_visual, generator=generator).mul(0.01).to(dtype)
    valid = torch.ones(2, rows, dtype=torch.bool)
    valid[1, 4:] = False
    low = build_evidence(prior, posterior, valid, last)
    ref = build_evidence(prior.float(), posterior.float(), valid, last.float())
    for got, want in ((low.prior, ref.prior), (low.posterior, ref.posterior), (low.last, ref.last)):
        assert got.dtype == torch.float32
        assert torch.equal(got, want)
    for name in ("priortr", "posterior", "fastv"):
        kept_low = select_top_k(get_rule(name).rule(low), 64)
        kept_ref = select_top_k(get_rule(name).rule(ref), 64)
        assert torch.equal(kept_low, kept_ref)


@pytest.mark.parametrize(
    ("prior", "posterior", "valid", "last", "match"),
    [
        (torch.ones(1, 3), torch.ones(1, 1, 1, 3), torch.tensor([[True]]), torch.ones(1, 1, 3), "prior_attn"),
        (
            torch.ones(1, 1, 3),
            torch.ones(1, 1, 1, 3),
            torch.tensor([[True]]),
            torch.ones(1, 2, 3),
            "last_attn",
        ),
        (
            torch.ones(1, 1, 3),
            torch.ones(1, 1, 3),
            torch.tensor([[True]]),
            torch.ones(1, 1, 3),
            "posterior_attn",
        ),
        (
            torch.ones(1, 1, 3),
            torch.ones(1, 1, 1, 4),
            torch.tensor([[True]]),
            torch.ones(1, 1, 3),
            "visual tokens",
        ),
        (torch.ones(1, 1, 3), torch.ones(1, 1, 1, 3), torch.tensor([[1]]), torch.ones(1, 1, 3), "bool"),
        (torch.ones(1, 1, 3), torch.ones(1, 1, 2, 3), torch.tensor([[True]]), torch.ones(1, 1, 3), "bool"),
        (
            torch.ones(1, 1, 3),
            torch.ones(1, 1, 1, 3),
            torch.tensor([[False]]),
            torch.ones(1, 1, 3),
            "no valid",
        ),
        (
            torch.zeros(1, 1, 3),
            torch.ones(1, 1, 1, 3),
            torch.tensor([[True]]),
            torch.ones(1, 1, 3),
            "normalise",
        ),
        (
            torch.ones(1, 1, 3),
            torch.zeros(1, 1, 1, 3),
            torch.tensor([[True]]),
            torch.ones(1, 1, 3),
            "normalise",
        ),
        (
            torch.ones(1, 1, 3),
            torch.ones(1, 1, 1, 3),
            torch.tensor([[True]]),
            torch.zeros(1, 1, 3),
            "normalise",
        ),
    ],
)
def test_build_evidence_rejects_bad_inputs(
    prior: torch.Tensor, posterior: torch.Tensor, valid: torch.Tensor, last: torch.Tensor, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        build_evidence(prior, posterior, valid, last)


def test_evidence_rejects_mismatched_shapes_and_dtypes() -> None:
    with pytest.raises(ValueError, match="share one shape"):
        Evidence(prior=torch.ones(1, 3), posterior=torch.ones(1, 4), last=torch.ones(1, 3))
    with pytest.raises(ValueError, match="float32"):
        Evidence(
            prior=torch.ones(1, 3, dtype=torch.float16), posterior=torch.ones(1, 3), last=torch.ones(1, 3)
        )
    with pytest.raises(ValueError, match=r"\[B, N\]"):
        Evidence(prior=torch.ones(3), posterior=torch.ones(3), last=torch.ones(3))


# --- budget ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "n_visual", "expected"),
    [
        (64, 576, 64),
        (1, 576, 1),
        (576, 576, 576),
        (1000, 576, 576),
        (0.5, 576, 288),
        (0.111, 576, 64),  # 63.936 -> 64
        (0.25, 6, 2),  # 1.5 rounds half up to 2
        (0.1, 5, 1),  # 0.5 rounds half up to 1
        (0.01, 5, 1),  # 0.05 -> 0, floored at 1
        (0.99, 10, 10),  # 9.9 -> 10
    ],
)
def test_resolve_budget(budget: int | float, n_visual: int, expected: int) -> None:
    assert resolve_budget(budget, n_visual) == expected


@pytest.mark.parametrize(
    ("budget", "match"),
    [
        (True, "bool"),
        (False, "bool"),
        (0, "positive token count"),
        (-3, "positive token count"),
        (0.0, r"pass an int for a token count, or a ratio in \(0, 1\)"),
        (-0.5, r"pass an int for a token count, or a ratio in \(0, 1\)"),
        (1.0, r"pass an int for a token count, or a ratio in \(0, 1\)"),
        (64.0, r"pass an int for a token count, or a ratio in \(0, 1\)"),
        (float("inf"), r"pass an int for a token count, or a ratio in \(0, 1\)"),
        (float("nan"), "NaN"),
        ("64", "int or float"),
        (None, "int or float"),
    ],
)
def test_resolve_budget_rejects(budget: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_budget(budget, 576)  # type: ignore[arg-type]


@pytest.mark.parametrize("n_visual", [0, -1, True, 3.0])
def test_resolve_budget_rejects_bad_n_visual(n_visual: object) -> None:
    with pytest.raises(ValueError, match="n_visual"):
        resolve_budget(4, n_visual)  # type: ignore[arg-type]


# --- selection ------------------------------------------------------------------------------------


def test_select_top_k_returns_ascending_long_indices() -> None:
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.8, 0.0, 0.9, 0.3]])
    kept = select_top_k(scores, 3)
    assert kept.dtype == torch.long
    assert kept.tolist() == [[1, 2, 3], [0, 2, 3]]


def test_select_top_k_all_equal_keeps_first_indices() -> None:
    kept = select_top_k(torch.zeros(2, 6), 3)
    assert kept.tolist() == [[0, 1, 2], [0, 1, 2]]


def test_select_top_k_ties_lower_index_wins() -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    assert select_top_k(scores, 2).tolist() == [[1, 2]]
    # Large tied block: beyond small-input fast paths, the lower indices must still win.
    many = torch.zeros(1, 5000)
    many[0, ::3] = 1.0  # 1667 top tokens at 0, 3, ..., 4998
    kept = select_top_k(many, 1700)
    top = list(range(0, 5000, 3))
    first_zeros = [i for i in range(5000) if i % 3][: 1700 - len(top)]  # 1, 2, 4, 5, ... (lowest indices)
    expected = sorted(top + first_zeros)
    assert kept.tolist()[0] == expected


def test_select_top_k_is_repeatable() -> None:
    scores = torch.tensor([[0.2, 0.2, 0.5, 0.2, 0.5, 0.1]] * 3)
    first = select_top_k(scores, 4)
    for _ in range(5):
        assert torch.equal(select_top_k(scores, 4), first)
    assert first.tolist()[0] == [0, 1, 2, 4]


def test_select_top_k_handles_infinite_scores() -> None:
    scores = torch.tensor([[float("-inf"), 0.0, float("inf"), -1.0]])
    assert select_top_k(scores, 2).tolist() == [[1, 2]]


@pytest.mark.parametrize(
    ("scores", "k", "match"),
    [
        (torch.tensor([[0.1, float("nan"), 0.3]]), 1, "NaN"),
        (torch.ones(1, 3), 0, "1 <= k <= N"),
        (torch.ones(1, 3), 4, "1 <= k <= N"),
        (torch.ones(1, 3), -1, "1 <= k <= N"),
        (torch.ones(1, 3), True, "1 <= k <= N"),
        (torch.ones(1, 3), 2.0, "1 <= k <= N"),
        (torch.ones(3), 1, r"\[B, N\]"),
    ],
)
def test_select_top_k_rejects(scores: torch.Tensor, k: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        select_top_k(scores, k)  # type: ignore[arg-type]
