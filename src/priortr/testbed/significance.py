"""How sure an accuracy is, and whether two methods differ on the same questions.

A cell of ``priortr eval`` answers a few hundred questions, so its accuracy has a sampling error of
several points: each accuracy gets a 95% Wilson score interval, and two methods answering the same
questions are compared with the exact McNemar test, which looks only at the questions where exactly one
of them is right (a paired test: far more sensitive than comparing two intervals).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Z_95 = 1.959963984540054
"""The standard normal quantile of 0.975."""


def wilson_interval(correct: int, total: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``correct / total`` (95% by default)."""
    if total < 1 or not 0 <= correct <= total:
        raise ValueError(f"need 0 <= correct <= total and total >= 1, got {correct} of {total}")
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Paired:
    """The exact McNemar test of method A against method B on the same questions."""

    only_a: int
    """Questions A answers right and B wrong."""
    only_b: int
    """Questions B answers right and A wrong."""
    p_value: float
    """Two-sided exact p-value: twice the binomial(only_a + only_b, 1/2) tail of the smaller count."""


def mcnemar(hits_a: Sequence[int], hits_b: Sequence[int]) -> Paired:
    """Compare two methods' per-question correctness (0/1, same questions in the same order)."""
    if len(hits_a) != len(hits_b):
        raise ValueError(f"the methods answered different question counts: {len(hits_a)} and {len(hits_b)}")
    only_a = sum(1 for a, b in zip(hits_a, hits_b, strict=True) if a and not b)
    only_b = sum(1 for a, b in zip(hits_a, hits_b, strict=True) if b and not a)
    n = only_a + only_b
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2**n
    return Paired(only_a, only_b, min(1.0, 2 * tail))
