"""Whether checks that read tensor values run: on for direct calls, off on the engine's hot path.

Reading a value of a tensor that lives on a GPU (``bool(t)``, ``if t.any():``, ``.item()``, ``nonzero``)
blocks the host until the device has finished everything queued before it. A check of that kind in a
prefill stage drains the queue that the engine is trying to keep full, so the engine runs its stages
with these checks off unless the user asks for them (``priortr.apply(..., strict=True)``). The pure
scoring and selection functions, called directly, keep them on.

The switch is a module global rather than a context variable so that torch.compile can trace the
pure part of a stage (scores -> top-K) with the checks off; it is process-wide.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_enabled = True


def value_checks() -> bool:
    """Whether checks that read tensor values should run now."""
    return _enabled


@contextmanager
def value_checks_enabled(enabled: bool) -> Iterator[None]:
    """Turn value-reading checks on or off inside the block (the engine: off unless ``strict``)."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous
