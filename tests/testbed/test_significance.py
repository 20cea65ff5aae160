"""Wilson intervals and the exact McNemar test against hand-computed values (the intervals also
match scipy.stats.binomtest(...).proportion_ci(method="wilson"))."""

from __future__ import annotations

import pytest

from priortr.testbed.significance import mcnemar, wilson_interval


@pytest.mark.parametrize(
    ("correct", "total", "low", "high"),
    [(0, 10, 0.0, 0.27753), (5, 10, 0.23659, 0.76341), (97, 100, 0.91548, 0.98975), (10, 10, 0.72247, 1.0)],
)
def test_wilson_interval(correct: int, total: int, low: float, high: float) -> None:
    assert wilson_interval(correct, total) == pytest.approx((low, high), abs=1e-5)


def test_wilson_interval_refuses_impossible_counts() -> None:
    with pytest.raises(ValueError, match="correct <= total"):
        wilson_interval(11, 10)
    with pytest.raises(ValueError, match="total >= 1"):
        wilson_interval(0, 0)


def test_mcnemar_counts_only_discordant_questions() -> None:
    # 6 questions only B answers, none only A, 4 both or neither: p = 2 * (1/2)^6.
    a = [0, 0, 0, 0, 0, 0, 1, 1, 0, 0]
    b = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    result = mcnemar(a, b)
    assert (result.only_a, result.only_b) == (0, 6)
    assert result.p_value == pytest.approx(2 / 64)


def test_mcnemar_balanced_disagreement_is_not_significant() -> None:
    # 3 and 2 discordant: p = 2 * (C(5,0) + C(5,1) + C(5,2)) / 32 = 2 * 16 / 32 = 1.
    a = [1, 1, 1, 0, 0, 1]
    b = [0, 0, 0, 1, 1, 1]
    assert mcnemar(a, b).p_value == 1.0
    assert mcnemar(a, a).p_value == 1.0  # identical answers: no evidence either way


def test_mcnemar_needs_the_same_questions() -> None:
    with pytest.raises(ValueError, match="different question counts"):
        mcnemar([1, 0], [1])
