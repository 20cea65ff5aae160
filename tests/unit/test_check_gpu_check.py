"""``scripts/check_gpu_check.py``, gpu-check.sh's last step: passes a complete output folder, and fails,
naming what is missing, when one file, row or column of the grid is not there."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_gpu_check.py"
GRID = ["--methods", "vanilla", "priortr", "--budgets", "64", "32", "--batch-sizes", "1", "8"]
PREFILL = {"wall_ms": 2.0, "q1_ms": 1.0, "q3_ms": 3.0, "host_ms": 1.5, "repeats": 3}
XML = '<testsuites><testsuite tests="{tests}" failures="{failures}" errors="0" skipped="0"/></testsuites>'


def bench_case(method: str, budget: int | None, batch: int) -> dict:
    numbers = ("lm_prefill_ms", "vision_ms", "kv_cache_bytes", "samples_per_s", "speedup", "limit_speedup")
    overhead = None if budget is None else {"median": 0.1}
    return {"method": method, "budget": budget, "batch": batch, "overhead_ms": overhead} | dict.fromkeys(
        numbers, 1.0
    )


def fast_rows(budget: int, batches: list[int], cuda: bool) -> list[dict]:
    syncs = dict.fromkeys(("predicted_prefill", "predicted_decode_step", "predicted_prefill_h2d"), 1)
    syncs |= dict.fromkeys(("cuda_prefill", "cuda_decode_step"), 2 if cuda else None)
    compiled = {**PREFILL, "graphs": 1, "breaks": 0, "recompiled_graphs": 0}
    rows = []
    for kept in (None, budget):
        rows += [
            {"what": "eager prefill, batch 1", "K": kept, **PREFILL},
            {"what": "syncs", "K": kept, **syncs},
            {"what": "compiled prefill, batch 1", "K": kept, **compiled},
        ]
        rows += [
            {"what": f"compiled static decode step, batch {b}", "K": kept, "step_ms": 1.0} for b in batches
        ]
    return rows


@pytest.fixture
def out(tmp_path) -> Path:
    """What a complete CUDA run of GRID with fast budget 64 writes."""
    (tmp_path / "env.txt").write_text(
        "Sun\npython 3.12\ntorch 2.11.0\ntransformers 5.17.0\ndevice NVIDIA H100\n"
    )
    (tmp_path / "tests.xml").write_text(XML.format(tests=68, failures=0))
    cases = [bench_case("vanilla", None, b) for b in (1, 8)]
    cases += [bench_case("priortr", k, b) for k in (64, 32) for b in (1, 8)]
    (tmp_path / "bench.json").write_text(json.dumps({"meta": {}, "cases": cases}))
    rows = fast_rows(64, [1, 8], cuda=True)
    (tmp_path / "fast.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for name in ("tests.log", "bench.log", "bench.md", "bench.jsonl", "bench.png", "fast.log", "fast.md"):
        (tmp_path / name).write_text("x")
    return tmp_path


def check(out: Path, device: str = "cuda") -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), str(out), "--device", device, *GRID, "--fast-budget", "64"]
    return subprocess.run(command, capture_output=True, text=True)


def drop_fast_row(out: Path, what: str, kept: int | None) -> None:
    rows = [json.loads(line) for line in (out / "fast.jsonl").read_text().splitlines()]
    kept_rows = [row for row in rows if (row["what"], row["K"]) != (what, kept)]
    assert len(kept_rows) == len(rows) - 1
    (out / "fast.jsonl").write_text("".join(json.dumps(row) + "\n" for row in kept_rows))


def test_a_complete_run_passes(out):
    run = check(out)
    assert run.returncode == 0, run.stderr
    assert "every file and row" in run.stdout


@pytest.mark.parametrize(
    ("what", "kept"),
    [
        ("compiled static decode step, batch 8", 64),
        ("compiled prefill, batch 1", None),
        ("syncs", 64),
        ("eager prefill, batch 1", None),
    ],
)
def test_a_missing_fast_row_fails_and_is_named(out, what, kept):
    drop_fast_row(out, what, kept)
    run = check(out)
    assert run.returncode == 1
    assert f"MISSING fast.jsonl: {what}, K={kept}: missing" in run.stderr.splitlines()


def test_cuda_sync_counts_are_required_on_cuda_only(out):
    rows = fast_rows(64, [1, 8], cuda=False)
    (out / "fast.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert check(out, device="cpu").returncode == 0
    run = check(out, device="cuda")
    assert run.returncode == 1 and "fast.jsonl: syncs, K=None: no cuda_prefill" in run.stderr


def test_a_missing_host_column_fails(out):
    rows = [json.loads(line) for line in (out / "fast.jsonl").read_text().splitlines()]
    rows[0]["host_ms"] = None
    (out / "fast.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = check(out)
    assert run.returncode == 1 and "fast.jsonl: eager prefill, batch 1, K=None: no host_ms" in run.stderr


def test_a_missing_bench_case_or_stage_time_fails(out):
    document = json.loads((out / "bench.json").read_text())
    document["cases"] = [c for c in document["cases"] if (c["budget"], c["batch"]) != (32, 8)]
    document["cases"][-1]["overhead_ms"] = None
    (out / "bench.json").write_text(json.dumps(document))
    run = check(out)
    assert run.returncode == 1
    assert "bench.json: priortr K=32 batch 8: missing" in run.stderr
    assert "no stage time (overhead_ms)" in run.stderr


def test_a_failed_test_or_a_missing_file_fails(out):
    (out / "tests.xml").write_text(XML.format(tests=68, failures=2))
    (out / "fast.md").unlink()
    run = check(out)
    assert run.returncode == 1
    assert "tests.xml: 2 failed, 0 errors (tests.log)" in run.stderr and "fast.md: missing" in run.stderr


def test_the_plot_is_expected_where_matplotlib_can_draw_it(out):
    """bench.png is required where matplotlib is installed (``priortr bench`` draws it), not elsewhere
    (it says why in bench.log)."""
    (out / "bench.png").unlink()
    run = check(out)
    if importlib.util.find_spec("matplotlib") is None:
        assert run.returncode == 0, run.stderr
    else:
        assert run.returncode == 1 and "bench.png: missing" in run.stderr
