"""Which transformers releases priortr supports, and the refusal for everything else.

priortr hooks into transformers' decoder layers and KV cache, whose contracts change between releases
(5.24 renamed the cache keyword). Every contract is resolved from the installed release when pruning
is attached; one that priortr does not recognise is refused with ``UnsupportedTransformers``, never
run unpruned or left to fail at decode.
"""

from __future__ import annotations

from typing import NoReturn

import transformers
from packaging.version import Version

FLOOR = "5.17.0"
"""The oldest release CI tests (the accelerator machines' image ships it)."""

NEWEST_TESTED = "5.25.0"
"""The newest release the pinned set-up (``constraints/tested.txt``) was tested with."""


class UnsupportedTransformers(RuntimeError):
    """The installed transformers builds models in a way priortr does not recognise."""


def installed() -> str:
    return transformers.__version__


def supported_range() -> str:
    return f">= {FLOOR} (tested from {FLOOR} to {NEWEST_TESTED})"


def refuse(what: str) -> NoReturn:
    """Raise ``UnsupportedTransformers`` for ``what``, naming the installed release and the range."""
    raise UnsupportedTransformers(
        f"{what}. Found transformers {installed()}; priortr supports transformers {supported_range()}. "
        f"Install a tested release (pip install 'transformers=={NEWEST_TESTED}') or report the new contract"
    )


def check_release() -> None:
    """Refuse a release older than the floor: its models take other arguments than the ones resolved here."""
    if Version(installed()).release < Version(FLOOR).release:
        refuse("this transformers release is older than the oldest supported one")
