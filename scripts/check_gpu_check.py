"""Fail when a file or row that ``scripts/gpu-check.sh`` should have written to its ``$OUT`` is missing.

    python scripts/check_gpu_check.py OUT --device cuda --methods vanilla fastv priortr --budgets 64 \\
        --batch-sizes 1 8 32 --fast-budget 64

gpu-check.sh runs it last, with the grid it ran (the same on a CPU with --tiny, smaller): a step that
stopped early, a row a run did not reach, or a column left empty fails the check, so the script's
exit status says whether the accelerator call gave everything, and CI's CPU run of it proves that it
does. Standard library only: it runs on whatever Python the script ran.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

FILES = ("env.txt", "tests.log", "tests.xml", "bench.log", "bench.json", "bench.md", "bench.jsonl")
FAST_FILES = ("fast.log", "fast.jsonl", "fast.md")
ENV_KEYS = ("python", "torch", "transformers", "device")
PREFILL_KEYS = ("wall_ms", "q1_ms", "q3_ms", "host_ms", "repeats")
SYNC_KEYS = ("predicted_prefill", "predicted_decode_step", "predicted_prefill_h2d")
CUDA_SYNC_KEYS = ("cuda_prefill", "cuda_decode_step")
COMPILED_KEYS = ("graphs", "breaks", "recompiled_graphs")
BENCH_KEYS = ("lm_prefill_ms", "vision_ms", "kv_cache_bytes", "samples_per_s", "speedup", "limit_speedup")


def expected_files() -> list[str]:
    """Every file of a full run; bench.png only where matplotlib can draw it (``priortr bench`` says
    so in bench.log where it cannot)."""
    drawn = ("bench.png",) if importlib.util.find_spec("matplotlib") else ()
    return [*FILES, *drawn, *FAST_FILES]


def check_env(text: str) -> list[str]:
    """env.txt names the python, torch, transformers and device."""
    found = {line.split()[0] for line in text.splitlines() if line.split()}
    return [f"env.txt: no {key!r} line" for key in ENV_KEYS if key not in found]


def check_tests(xml: str) -> list[str]:
    """tests.xml: some tests ran, none failed or errored."""
    suites = ElementTree.fromstring(xml)
    suites = [suites] if suites.tag == "testsuite" else list(suites.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors")}
    problems = []
    if counts["tests"] - sum(int(s.get("skipped", 0)) for s in suites) <= 0:
        problems.append("tests.xml: no test ran")
    if counts["failures"] or counts["errors"]:
        problems.append(f"tests.xml: {counts['failures']} failed, {counts['errors']} errors (tests.log)")
    return problems


def check_bench(document: dict, methods: list[str], budgets: list[int], batches: list[int]) -> list[str]:
    """bench.json: one case per method x budget x batch (vanilla once per batch), every number set,
    and the stage time on each pruned case."""
    cases = {(c["method"], c["budget"], c["batch"]): c for c in document.get("cases", [])}
    problems = []
    for method in methods:
        for budget in [None] if method == "vanilla" else budgets:
            for batch in batches:
                case = cases.get((method, budget, batch))
                name = f"bench.json: {method} K={budget} batch {batch}"
                if case is None:
                    problems.append(f"{name}: missing")
                    continue
                problems += [f"{name}: no {key}" for key in BENCH_KEYS if case.get(key) is None]
                if method != "vanilla" and case.get("overhead_ms") is None:
                    problems.append(f"{name}: no stage time (overhead_ms)")
    return problems


def check_fast(rows: list[dict], device: str, budget: int, batches: list[int]) -> list[str]:
    """fast.jsonl: vanilla and PriorTR at ``budget`` for the batch-1 eager and compiled prefill, the
    syncs (CUDA's own count on CUDA), and the compiled static decode step at every batch size."""
    found = {(row["what"], row["K"]): row for row in rows}
    wanted = {
        "eager prefill, batch 1": PREFILL_KEYS,
        "compiled prefill, batch 1": PREFILL_KEYS + COMPILED_KEYS,
        "syncs": SYNC_KEYS + (CUDA_SYNC_KEYS if device == "cuda" else ()),
    }
    wanted |= {f"compiled static decode step, batch {b}": ("step_ms",) for b in batches}
    problems = []
    for what, keys in wanted.items():
        for kept in (None, budget):
            name, row = f"fast.jsonl: {what}, K={kept}", found.get((what, kept))
            if row is None:
                problems.append(f"{name}: missing")
            else:
                problems += [f"{name}: no {key}" for key in keys if row.get(key) is None]
    return problems


def problems(out: Path, args: argparse.Namespace) -> list[str]:
    """Everything missing from ``out``, one line each (empty: the run is complete)."""
    missing = [f"{name}: missing" for name in expected_files() if not (out / name).is_file()]
    readers = {
        "env.txt": check_env,
        "tests.xml": check_tests,
        "bench.json": lambda text: check_bench(
            json.loads(text), args.methods, args.budgets, args.batch_sizes
        ),
        "fast.jsonl": lambda text: check_fast(
            [json.loads(line) for line in text.splitlines() if line.strip()],
            args.device,
            args.fast_budget,
            args.batch_sizes,
        ),
    }
    for name, read in readers.items():
        if (out / name).is_file():
            missing += read((out / name).read_text())
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder gpu-check.sh wrote ($OUT)")
    parser.add_argument("--device", required=True)
    parser.add_argument("--methods", nargs="+", required=True)
    parser.add_argument("--budgets", type=int, nargs="+", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", required=True)
    parser.add_argument("--fast-budget", type=int, required=True)
    args = parser.parse_args()
    found = problems(args.out, args)
    for line in found:
        print(f"MISSING {line}", file=sys.stderr)
    print(f"gpu-check output in {args.out}: " + (f"{len(found)} problems" if found else "every file and row"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
