"""An append-only JSONL record of a long run (``priortr eval``, ``priortr bench``), so that a run keeps
its work: one line per finished measurement, flushed as it is written, read back by ``--resume``.

The first line holds the run's settings; a resumed run must have the same settings (a different model
or dtype would mix two experiments in one table), while the list of configurations may grow. A last
line cut short by a crash is dropped before anything is appended after it. The record is locked while
a run holds it open, so a second run into the same folder is refused instead of overwriting the first
one's work; outputs written from it are replaced whole (``write_whole``), never left half-written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any


class Journal:
    """``path``'s records, and an open, locked handle to append new ones (until ``close()``, or the end
    of a ``with`` block)."""

    def __init__(self, path: Path, settings: dict[str, Any], resume: bool) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = path.open("a+b")  # created if missing, never truncated before the lock
        try:
            _lock(self._file, path)
            self._file.seek(0)
            lines = self._file.read().decode().splitlines(keepends=True)
            if len(lines) > 1:  # a previous run recorded something (a bare header is a run that did nothing)
                self._continue(lines, settings, resume)
            else:
                self._file.truncate(0)
                self._write({"settings": settings})
        except BaseException:
            self._file.close()
            raise

    def _continue(self, lines: list[str], settings: dict[str, Any], resume: bool) -> None:
        if not resume:
            raise ValueError(
                f"{self.path} holds a previous run; pass --resume to continue it, or choose another --out"
            )
        recorded = _parse(lines[0])
        if recorded is None or recorded.get("settings") != settings:
            changed = _differences((recorded or {}).get("settings", {}), settings)
            raise ValueError(
                f"--resume: {self.path} was recorded with other settings ({changed}); "
                "use the same arguments, or another --out"
            )
        if not lines[-1].endswith("\n"):  # cut short by a crash: appending to it would break the next line
            self._file.truncate(sum(len(line.encode()) for line in lines[:-1]))
            lines = lines[:-1]
        self.records = [r for r in map(_parse, lines[1:]) if r is not None]

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._write(record)

    def close(self) -> None:
        self._file.close()  # releases the lock

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write((json.dumps(record) + "\n").encode())
        self._file.flush()


def _lock(file: IO[bytes], path: Path) -> None:
    """Hold ``file`` exclusively until it is closed (the system releases it if the process dies)."""
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(
            f"{path} is being written by another run right now; "
            "wait for it to finish, or choose another --out"
        ) from None


def write_whole(path: Path, write: Callable[[Path], object]) -> Path:
    """Write ``path`` through ``write(temporary path)`` in the same folder, then rename it into place,
    so that an interrupted or concurrent write leaves the old file or the new one, never a part."""
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.partial{path.suffix}")
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


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
