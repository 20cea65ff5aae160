"""An append-only JSONL record of a long run (``priortr eval``, ``priortr bench``), so that a run keeps
its work: one line per finished measurement, flushed as it is written, read back by ``--resume``.

The first line holds the run's settings; a resumed run must have the same settings (a different model
or dtype would mix two experiments in one table), while the list of configurations may grow. A last
line cut short by a crash is ignored.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class Journal:
    """``path``'s records, and an open handle to append new ones."""

    def __init__(self, path: Path, settings: dict[str, Any], resume: bool) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        lines = path.read_text().splitlines() if path.is_file() else []
        if len(lines) > 1:  # a previous run recorded something (a bare header is a run that did nothing)
            if not resume:
                raise ValueError(
                    f"{path} holds a previous run; pass --resume to continue it, or choose another --out"
                )
            recorded = _parse(lines[0])
            if recorded is None or recorded.get("settings") != settings:
                changed = _differences((recorded or {}).get("settings", {}), settings)
                raise ValueError(
                    f"--resume: {path} was recorded with other settings ({changed}); "
                    "use the same arguments, or another --out"
                )
            self.records = [r for r in map(_parse, lines[1:]) if r is not None]
            self._file = path.open("a")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("w")
            self._write({"settings": settings})

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._write(record)

    def close(self) -> None:
        self._file.close()

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


def _parse(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} then, {new.get(k)!r} now" for k in keys) or "unreadable header"


@contextlib.contextmanager
def finished_so_far(table: Callable[[], str], journal: Path) -> Iterator[None]:
    """On Ctrl-C or a failure inside the block, print the table of what finished and how to resume."""
    try:
        yield
    except BaseException:
        print(table(), end="")
        print(f"stopped early; what finished is recorded in {journal}: rerun with --resume to continue")
        raise
