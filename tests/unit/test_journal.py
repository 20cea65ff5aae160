"""The record of a long run (``priortr.tools.journal``): one run at a time per record, a line cut short by a
crash never breaks the lines appended after it, and outputs are replaced whole."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from priortr.tools.journal import Journal, write_whole


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_second_run_on_a_record_in_use_is_refused_and_the_first_loses_nothing(tmp_path):
    path = tmp_path / "run.jsonl"
    first = Journal(path, {"model": "a"}, resume=False)
    first.append({"answer": 1})
    for resume in (False, True):
        with pytest.raises(ValueError, match="being written by another run right now"):
            Journal(path, {"model": "a"}, resume=resume)
    first.append({"answer": 2})
    first.close()
    assert lines(path) == [{"settings": {"model": "a"}}, {"answer": 1}, {"answer": 2}]
    with Journal(path, {"model": "a"}, resume=True) as resumed:  # free again once closed
        assert resumed.records == [{"answer": 1}, {"answer": 2}]


def test_the_lock_holds_across_processes_and_is_released_when_the_holder_dies(tmp_path):
    path = tmp_path / "run.jsonl"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from priortr.tools.journal import Journal; "
            f"j = Journal(pathlib.Path({str(path)!r}), {{}}, False); j.append({{'a': 1}}); "
            "print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="another run"):
            Journal(path, {}, resume=True)
    finally:
        holder.kill()  # no close(): the system drops the lock of a dead process
        holder.wait()
    assert Journal(path, {}, resume=True).records == [{"a": 1}]


def test_a_line_cut_short_is_dropped_before_the_next_is_appended(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps({"settings": {}}) + "\n" + json.dumps({"a": 1}) + '\n{"a": 2, "rep')
    with Journal(path, {}, resume=True) as journal:
        assert journal.records == [{"a": 1}]
        journal.append({"a": 3})
    assert lines(path) == [{"settings": {}}, {"a": 1}, {"a": 3}]  # before: '{"a": 2, "rep{"a": 3}'


def test_an_output_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "table.md"
    path.write_text("old\n")

    def fails(partial):
        partial.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_whole(path, fails)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["table.md"]
    assert write_whole(path, lambda partial: partial.write_text("new\n")) == path
    assert path.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["table.md"]
