"""The lmms-eval plug-in under data parallelism, for real: two CPU processes against one; offline.

``accelerate launch --multi_gpu --num_processes 2`` is the launcher an 8-GPU node uses (torchrun under
the hood); ``ACCELERATE_USE_CPU=true`` and no visible GPU make each process's ``Accelerator`` pick the
CPU (gloo). ``accelerate launch --cpu --num_processes 2`` would start one process only: accelerate runs
several CPU processes through mpirun. The launcher is called as ``python -m accelerate.commands.launch``
(what ``accelerate launch`` runs) because the ``accelerate`` entry point imports all its subcommands,
and ``estimate`` imports timm, which fails without the torchvision that setup.sh removes.

Every request is counted where it runs: the local task's ``doc_to_visual`` logs (process, record) on
each call (``tests/helpers/lmms_task/utils.py``), and the plug-in calls it once per request it runs. The 5
records do not split evenly over 2 processes, so lmms-eval pads the second one with copies of its
last requests: the counts also show that those copies are not run.

Three lmms-eval runs, 60 to 75 s together on 2 CPU cores (most of it lmms-eval starting up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

pytest.importorskip("lmms_eval")

from priortr.cli import main
from priortr.tools import report
from tests.helpers.checkpoint import save_tiny_llava_checkpoint
from tests.helpers.lmms import BUDGET, N_VISUAL, TASK_DIR, lmms_eval_command
from tests.helpers.lmms_task.utils import CALLS_ENV, CHOICES, RECORDS, write_local_dataset
from tests.helpers.server import free_port

TASKS = ("priortr_local_gen", "priortr_local_mc")
CALLS_PER_RECORD = 1 + len(CHOICES)  # one generate_until request, one loglikelihood request per choice


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Output folders of three runs on the local tasks, batch size 1, float64: ``one`` and ``two``
    processes with budget 4, and ``vanilla`` (budget 16 = every visual token kept, one process)."""
    root = tmp_path_factory.mktemp("lmms-dp")
    checkpoint = save_tiny_llava_checkpoint(root / "tiny-llava")
    data = write_local_dataset(root / "data").parent
    launch_two = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        "-m",
        "lmms_eval",
    ]
    outs = {}
    for name, launcher, budget in [
        ("one", lmms_eval_command(), BUDGET),
        ("two", launch_two, BUDGET),
        ("vanilla", lmms_eval_command(), N_VISUAL),
    ]:
        outs[name] = root / name
        env = os.environ | {
            "HF_HOME": str(root / "hf-home"),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "ACCELERATE_USE_CPU": "true",
            "CUDA_VISIBLE_DEVICES": "",
            CALLS_ENV: str(root / f"{name}.calls"),
        }
        args = [
            "--model",
            "priortr",
            "--model_args",
            f"pretrained={checkpoint},method=priortr,budget={budget},layer=1,dtype=float64",
            "--tasks",
            ",".join(TASKS),
            "--include_path",
            str(TASK_DIR),
            "--batch_size",
            "1",
            "--output_path",
            str(outs[name]),
            "--log_samples",
        ]
        run = subprocess.run(
            [*launcher, *args], cwd=data, env=env, capture_output=True, text=True, timeout=300
        )
        log = run.stdout[-4000:] + run.stderr[-8000:]
        # lmms-eval exits 0 even when a task fails: the results file is the real check
        assert run.returncode == 0 and len(list(outs[name].rglob("*_results.json"))) == 1, log
    return outs


def _results(out: Path) -> dict:
    return json.loads(next(out.rglob("*_results.json")).read_text())


def _samples(out: Path, task: str) -> dict[int, dict]:
    lines = next(out.rglob(f"*_samples_{task}.jsonl")).read_text().splitlines()
    return {sample["doc_id"]: sample for sample in map(json.loads, lines)}


def _calls(runs: dict[str, Path], name: str) -> list[tuple[str, int]]:
    text = (runs[name].parent / f"{name}.calls").read_text()
    return [(pid, int(record)) for pid, record in (line.split() for line in text.splitlines())]


def test_two_processes_give_the_same_outputs_sample_by_sample(runs: dict[str, Path]) -> None:
    for task in TASKS:
        one, two = _samples(runs["one"], task), _samples(runs["two"], task)
        assert sorted(one) == sorted(two) == list(range(len(RECORDS)))
        for doc_id, sample in one.items():
            # batch size 1: every request is computed alone, so the outputs are bit-identical
            assert two[doc_id]["filtered_resps"] == sample["filtered_resps"], (task, doc_id)
            assert two[doc_id]["target"] == sample["target"]
    assert _results(runs["two"])["results"] == _results(runs["one"])["results"]


def test_each_request_runs_once_on_one_of_the_two_processes(runs: dict[str, Path]) -> None:
    records = range(len(RECORDS))
    for name, processes in [("one", 1), ("two", 2)]:
        calls = _calls(runs, name)
        assert Counter(record for _, record in calls) == dict.fromkeys(records, CALLS_PER_RECORD), name
        where = defaultdict(set)
        for pid, record in calls:
            where[record].add(pid)
        assert all(len(pids) == 1 for pids in where.values()), (name, where)  # a record stays on one process
        assert len({pid for pid, _ in calls}) == processes, name


def test_kept_token_statistics_are_summed_over_the_processes(runs: dict[str, Path]) -> None:
    one, two = _results(runs["one"])["throughput"], _results(runs["two"])["throughput"]
    for throughput in (one, two):
        assert throughput["avg_kept_tokens"] == BUDGET and throughput["avg_visual_tokens"] == N_VISUAL
        assert throughput["avg_unpruned_requests"] == 0
    # the same answers, so the same generated tokens: only if the second process's are counted too
    assert two["total_gen_tokens"] == one["total_gen_tokens"] > 0


def test_report_on_the_local_results(runs: dict[str, Path], tmp_path: Path, capsys) -> None:
    table = report.build_table(report.load_runs([runs["vanilla"], runs["one"]]))
    assert [(row.method, row.budget_label) for row in table.rows] == [
        ("vanilla", "16"),
        ("priortr", str(BUDGET)),
    ]
    assert table.tasks == sorted(TASKS)  # not paper benchmarks: by name, each in its own first metric
    vanilla, pruned = (_results(runs[name])["results"] for name in ("vanilla", "one"))
    keys = {"priortr_local_gen": "exact_match,none", "priortr_local_mc": "acc,none"}
    ratios = [pruned[task][key] / vanilla[task][key] for task, key in keys.items() if vanilla[task][key]]
    assert ratios, "the random model scored 0 on both tasks: no retention to check"
    assert table.rows[1].scores == {task: pruned[task][key] for task, key in keys.items()}
    assert table.rows[1].avg == pytest.approx(100 * sum(ratios) / len(ratios))

    assert main(["report", str(runs["vanilla"]), str(runs["one"]), "--out", str(tmp_path)]) == 0
    assert {path.name for path in tmp_path.iterdir()} == {"table.md", "table.csv", "retention.png"}
    capsys.readouterr()
    # the one- and two-process runs are the same row: the second copy of a cell is refused
    assert main(["report", str(runs["vanilla"]), str(runs["one"]), str(runs["two"])]) == 2
    assert "is in two results files" in capsys.readouterr().err
