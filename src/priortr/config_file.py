"""A pruning setting in a file: what ``priortr calibrate`` recommends, so that it travels with the model.

The file is a JSON object of ``priortr.apply``'s keywords (``method``, ``budget``, ``layer``, ``options``,
...) plus an optional ``"calibration"`` object that records where the setting came from and is not read
back. This module only checks the file's shape and its key names (against ``defaults``, the keywords
``priortr.api.apply_defaults`` lists); the values are checked by ``apply`` itself, so a setting from a
file is refused for exactly the reasons a setting from Python is. It sits in the core, below the API,
because ``apply(config=...)`` reads these files; it imports nothing from priortr.

    {"method": "priortr", "budget": 32, "layer": 4,
     "calibration": {"agreement": 0.97, "speedup": 1.8, "data": "scenes-train"}}
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METADATA = "calibration"  # informational: the measurement behind the setting, ignored by readers


def parse_budget(value: int | float | str | None) -> int | float | None:
    """A budget given as text (the command line, lmms-eval's ``model_args``): an integer literal is a
    token count, anything else a ratio; numbers and None pass through. ``apply`` checks the range."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        return int(text) if re.fullmatch(r"[+-]?\d+", text) else float(text)
    except ValueError:
        raise ValueError(f"not a number: {value!r}") from None


def read_config(path: str | Path, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The ``apply`` keywords stored in ``path`` (only those the file sets); ``defaults``: every keyword
    a file may set."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read config {str(path)!r}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"config {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise ValueError(f"config {str(path)!r} must hold a JSON object of priortr.apply keywords")
    unknown = sorted(set(document) - set(defaults) - {METADATA})
    if unknown:
        raise ValueError(
            f"config {str(path)!r} has unknown keys {unknown}; a config holds priortr.apply keywords "
            f"({', '.join(defaults)}) and an optional {METADATA!r} object"
        )
    return {name: value for name, value in document.items() if name != METADATA}


def write_config(
    path: str | Path,
    arguments: Mapping[str, Any],
    defaults: Mapping[str, Any],
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``apply`` keywords (and the optional calibration record) as a config file; ``defaults``:
    every keyword a file may set."""
    unknown = sorted(set(arguments) - set(defaults))
    if unknown:
        raise ValueError(f"not priortr.apply keywords: {unknown}")
    document = dict(arguments)
    if metadata:
        document[METADATA] = dict(metadata)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def merge(path: str | Path, given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``apply`` keywords from the file at ``path`` and from a call's ``given`` keywords (``defaults``:
    every keyword with its default).

    A keyword left at its default takes the file's value; one passed explicitly (not at its default)
    is kept, unless the file sets it to something else: that is refused, since either could be meant.
    """
    stored = read_config(path, defaults)
    merged = dict(given)
    for name, value in stored.items():
        passed = given.get(name, defaults[name])
        if passed != defaults[name] and passed != value:
            raise ValueError(
                f"{name}={passed!r} was passed and config {str(path)!r} sets {name}={value!r}; "
                "pass one of them (edit the file, or leave the keyword out)"
            )
        merged[name] = value
    return merged
