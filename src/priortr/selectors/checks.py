"""Input checks shared by the selectors: bad evidence or knobs fail with a message naming the method."""

from __future__ import annotations

import torch

from priortr.checks import value_checks
from priortr.selection import StageInputs


def check_budget(inputs: StageInputs, method: str) -> int:
    """Validate ``inputs.hidden`` [B, N, D] (finite) and the budget K >= 1; return K."""
    hidden = inputs.hidden
    if hidden is None or hidden.ndim != 3:
        shape = None if hidden is None else tuple(hidden.shape)
        raise ValueError(
            f"{method} needs inputs.hidden, the visual tokens' hidden states [B, N, D], got {shape}"
        )
    if value_checks() and not torch.isfinite(hidden).all():
        raise ValueError(f"{method}: inputs.hidden contains NaN or inf; cannot compare visual tokens")
    budget = inputs.budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(
            f"{method}: inputs.budget must be an int >= 1 (visual tokens kept per image), got {budget!r}"
        )
    return budget


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` if it is an int >= ``minimum`` (not a bool); otherwise raise naming the knob."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value
