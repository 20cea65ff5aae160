"""The paper's accuracy tables from lmms-eval result folders (``priortr report``).

    priortr report results/ --baseline vanilla --out table/

Every ``*_results.json`` that lmms-eval wrote under the given folders is one run of one model with one
method and budget on one or more tasks. The table has a row per (model, budget, method) and a column
per benchmark, in the benchmark's own metric as the paper prints it (``PAPER_BENCHMARKS``; a task not
listed there shows its first metric as is), and the paper's Avg %: the mean over the row's benchmarks
of score / baseline score, times 100, against the same model's baseline run.

The baseline is the unpruned model, labelled ``vanilla``: a ``--model priortr`` run that kept every
visual token (``throughput.avg_kept_ratio`` 1, e.g. ``budget=576`` on LLaVA-1.5), or a run of another
lmms-eval model (``llava_hf``...). Other priortr runs are labelled with their ``method`` model arg.

Plain JSON and CSV in, markdown, CSV and one matplotlib figure out: no torch. Bad input raises
``ReportError``, whose message says what to fix.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VANILLA = "vanilla"
"""The unpruned model's row, in every table and journal of the tools (bench, calibrate, eval, report)."""
RESULTS_GLOB = "*_results.json"  # lmms-eval's EvaluationTracker: <output_path>/<model>/<date>_results.json
DEFAULT_METHOD, DEFAULT_BUDGET = "priortr", "64"  # the plug-in's defaults, when model_args omit them
OTHER_DECIMALS = 3  # a task outside the paper's table: its metric as lmms-eval reports it, often in [0, 1]


class ReportError(ValueError):
    """Input the table cannot be built from; the message names the file or run and the fix."""


@dataclass(frozen=True)
class Benchmark:
    """How one lmms-eval task shows in the table: its column, the results.json keys summed into its
    score, the factor to the paper's scale, and the decimals printed."""

    column: str
    metrics: tuple[str, ...]
    scale: float = 1.0
    decimals: int = 1


# The paper's LLaVA-1.5 table, in its column order; scales inferred from its vanilla row
# (docs/lmms-eval.md): x100 for fractions, MME = perception + cognition, NoCaps CIDEr as a fraction.
PAPER_BENCHMARKS: dict[str, Benchmark] = {
    "gqa": Benchmark("GQA", ("exact_match,none",), 100),
    "pope": Benchmark("POPE", ("pope_f1_score,none",), 100),
    "mme": Benchmark("MME", ("mme_perception_score,none", "mme_cognition_score,none"), decimals=0),
    "mmbench_en_dev": Benchmark("MMB", ("gpt_eval_score,none",)),
    "textvqa_val": Benchmark("TextVQA", ("exact_match,none",), 100),
    "seedbench": Benchmark("SEED", ("seed_image,none",), 100),
    "vizwiz_vqa_val": Benchmark("VizWiz", ("exact_match,none",), 100),
    "scienceqa_img": Benchmark("SQA", ("exact_match,none",), 100),
    "flickr30k_test": Benchmark("Flickr", ("flickr_CIDEr,none",), 100),
    "nocaps_val": Benchmark("NoCaps", ("nocaps_CIDEr,none",), decimals=2),
    "ok_vqa_val2014": Benchmark("OKVQA", ("exact_match,none",), 100),
    "mmvet": Benchmark("MMVet", ("gpt_eval_score,none",)),
}


@dataclass(frozen=True)
class Run:
    """One results file: the model, method and budget it ran with, and a score per task."""

    path: Path
    model: str
    method: str
    budget: int | float | None  # kept visual tokens per image (count or ratio); None: unpruned
    visual_tokens: float | None  # visual tokens per request, from the plug-in's throughput log
    scores: dict[str, float]  # task -> score in the benchmark's metric and scale


@dataclass
class Row:
    """One (model, budget, method) of the table: scores per task and their retention of the baseline."""

    model: str
    method: str
    budget: int | float | None
    scores: dict[str, float] = field(default_factory=dict)
    sources: dict[str, Path] = field(default_factory=dict)
    visual_tokens: set[float] = field(default_factory=set)
    retention: dict[str, float] = field(default_factory=dict)  # task -> score / baseline score

    @property
    def avg(self) -> float | None:
        """The paper's Avg %: mean retention over the tasks that have one, in percent."""
        if not self.retention:
            return None
        return 100 * sum(self.retention.values()) / len(self.retention)

    @property
    def budget_label(self) -> str:
        """The budget; for the unpruned row, its visual tokens when every run agrees (576), else all."""
        if self.budget is not None:
            return str(self.budget)
        if len(self.visual_tokens) == 1:
            tokens = next(iter(self.visual_tokens))
            return str(int(tokens)) if tokens.is_integer() else f"{tokens:.1f}"
        return "all"


@dataclass
class Table:
    """Rows grouped by model (baseline first, then budgets from large to small) and task columns."""

    baseline: str
    tasks: list[str]
    rows: list[Row]

    def partial(self, row: Row) -> bool:
        """Whether the row's Avg covers fewer benchmarks than the table has."""
        return len(row.retention) < len(self.tasks)


def benchmark(task: str, entry: dict[str, Any]) -> Benchmark | None:
    """The task's benchmark: the paper's, else its first numeric metric as is, or its first metric when
    none is numeric (``read_run`` refuses it then); None for an entry with no metric (a group)."""
    if task in PAPER_BENCHMARKS:
        return PAPER_BENCHMARKS[task]
    metrics = [key for key in entry if key != "alias" and "stderr" not in key]
    numeric = [key for key in metrics if _is_number(entry[key])]
    return Benchmark(task, ((numeric or metrics)[0],), decimals=OTHER_DECIMALS) if metrics else None


def _is_number(value: object) -> bool:
    """An int or a float (True and False are not scores)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return _is_number(value) and math.isfinite(value)


def parse_model_args(model_args: str | dict[str, Any]) -> dict[str, str]:
    """lmms-eval's ``key=value,key=value`` string (or the dict the Python API may store) as a dict."""
    if isinstance(model_args, dict):
        return {key: str(value) for key, value in model_args.items()}
    pairs = (item.split("=", 1) for item in model_args.split(",") if "=" in item)
    return {key.strip(): value.strip() for key, value in pairs}


def _number(text: str) -> int | float:
    """A finite number from text, or ValueError."""
    value = int(text) if text.lstrip("+-").isdigit() else float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def read_run(path: Path) -> Run:
    """One ``*_results.json`` as a ``Run``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: not a readable lmms-eval results JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict) or "config" not in data:
        raise ReportError(f"{path}: no 'results' and 'config' in it: not an lmms-eval results file")
    config = data["config"]
    args = parse_model_args(config.get("model_args") or {})
    model = args.get("pretrained") or str(config.get("model", "?"))
    throughput = data.get("throughput") or {}
    unpruned = config.get("model") != "priortr" or throughput.get("avg_kept_ratio") == 1
    try:
        budget = None if unpruned else _number(args.get("budget", DEFAULT_BUDGET))
    except ValueError:
        raise ReportError(f"{path}: budget={args['budget']!r} in model_args is not a finite number") from None
    visual_tokens = throughput.get("avg_visual_tokens")
    if visual_tokens is not None and not _is_finite(visual_tokens):
        raise ReportError(f"{path}: throughput avg_visual_tokens is {visual_tokens!r}, not a finite number")
    scores = {}
    for task, entry in data["results"].items():
        if not isinstance(entry, dict):
            raise ReportError(
                f"{path}: results of task {task} is {entry!r}, not an object of metrics: "
                "not an lmms-eval results file"
            )
        bench = benchmark(task, entry)
        if bench is None:
            continue
        for key in bench.metrics:
            if key not in entry:
                raise ReportError(f"{path}: task {task} has no metric {key}")
            if not _is_finite(entry[key]):
                raise ReportError(
                    f"{path}: task {task}, metric {key} is {entry[key]!r}, not a finite number; "
                    "rerun the task, or leave this file out"
                )
        scores[task] = bench.scale * sum(entry[key] for key in bench.metrics)
    return Run(
        path=path,
        model=model,
        method=VANILLA if unpruned else args.get("method", DEFAULT_METHOD),
        budget=budget,
        visual_tokens=visual_tokens,
        scores=scores,
    )


def load_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Every results file under the given folders (or the files themselves), in path order."""
    runs = []
    for given in map(Path, paths):
        if given.is_file():
            files = [given]
        elif given.is_dir():
            files = sorted(given.rglob(RESULTS_GLOB))
            if not files:
                raise ReportError(
                    f"{given}: no lmms-eval results ({RESULTS_GLOB}) in this folder or below; pass the "
                    "--output_path of a finished lmms-eval run"
                )
        else:
            raise ReportError(f"{given}: no such file or folder")
        runs.extend(read_run(path) for path in files)
    return runs


def _rows(runs: list[Run]) -> dict[tuple[str, str, int | float | None], Row]:
    """Runs merged into rows; a task twice in one row is refused."""
    rows: dict[tuple[str, str, int | float | None], Row] = {}
    for run in runs:
        row = rows.setdefault((run.model, run.method, run.budget), Row(run.model, run.method, run.budget))
        for task, score in run.scores.items():
            if task in row.scores:
                raise ReportError(
                    f"{task} of {run.model}, {run.method} at budget {row.budget_label}, is in two results "
                    f"files: {row.sources[task]} and {run.path}; keep one"
                )
            row.scores[task], row.sources[task] = score, run.path
        if run.visual_tokens is not None:
            row.visual_tokens.add(float(run.visual_tokens))
    return rows


def _retention(rows: list[Row], baseline: str) -> None:
    """Fill each row's retention against the baseline row of its model, checking the baseline has every
    task; a task whose baseline score is 0 has no retention."""
    for model in dict.fromkeys(row.model for row in rows):
        mine = [row for row in rows if row.model == model]
        bases = [row for row in mine if row.method == baseline]
        if not bases:
            methods = ", ".join(sorted({row.method for row in mine}))
            raise ReportError(
                f"no {baseline!r} run of {model} among the results (methods found: {methods}); Avg % is "
                f"relative to it: run lmms-eval with --model priortr and a budget of at least the visual "
                f"tokens (budget=576 for LLaVA-1.5) on the same tasks, or name another method with --baseline"
            )
        if len(bases) > 1:
            budgets = ", ".join(row.budget_label for row in bases)
            raise ReportError(f"{len(bases)} {baseline!r} rows of {model} (budgets {budgets}): keep one")
        base = bases[0]
        for row in mine:
            missing = sorted(set(row.scores) - set(base.scores))
            if missing:
                raise ReportError(
                    f"{model}: {row.method} at budget {row.budget_label} has {', '.join(missing)} but the "
                    f"{baseline!r} run does not; evaluate the {baseline!r} run on them too, or leave them out"
                )
            row.retention = {
                task: score / base.scores[task] for task, score in row.scores.items() if base.scores[task]
            }


def _order(row: Row, baseline: str) -> tuple[bool, float, str]:
    budget = math.inf if row.budget is None else row.budget
    return (row.method != baseline, -budget, row.method)


def build_table(runs: list[Run], baseline: str = VANILLA) -> Table:
    """The table of ``runs``: rows by model (in the order first seen), the baseline row first, then by
    budget from large to small and method; columns in the paper's order, then other tasks by name."""
    if not runs:
        raise ReportError("no results to tabulate")
    rows = list(_rows(runs).values())
    _retention(rows, baseline)
    models = list(dict.fromkeys(row.model for row in rows))
    rows.sort(key=lambda row: (models.index(row.model), *_order(row, baseline)))
    present = {task for row in rows for task in row.scores}
    tasks = [task for task in PAPER_BENCHMARKS if task in present]
    tasks += sorted(present - set(PAPER_BENCHMARKS))
    return Table(baseline, tasks, rows)


def _column(task: str) -> Benchmark:
    return PAPER_BENCHMARKS.get(task) or Benchmark(task, (), decimals=OTHER_DECIMALS)


def to_markdown(table: Table) -> str:
    """The table as markdown, scores rounded as the paper prints them."""
    columns = [_column(task) for task in table.tasks]
    lines = [
        "| model | budget | method | " + " | ".join(c.column for c in columns) + " | Avg % |",
        "| --- | ---: | --- | " + " | ".join("---:" for _ in columns) + " | ---: |",
    ]
    for row in table.rows:
        cells = [
            f"{row.scores[task]:.{c.decimals}f}" if task in row.scores else "-"
            for task, c in zip(table.tasks, columns, strict=True)
        ]
        avg = "-" if row.avg is None else f"{row.avg:.1f}" + ("*" if table.partial(row) else "")
        lines.append(f"| {row.model} | {row.budget_label} | {row.method} | {' | '.join(cells)} | {avg} |")
    lines.append("")
    lines.append(
        f"Avg %: mean over the benchmarks of score / {table.baseline} score of the same model, x 100."
    )
    if any(table.partial(row) for row in table.rows):
        lines.append("*: over the benchmarks that row has a score for (a dash, or a baseline score of 0).")
    return "\n".join(lines) + "\n"


def to_csv(table: Table) -> str:
    """The table as CSV, unrounded: benchmark columns by their table names, then ``avg_retention_pct``."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(
        ["model", "budget", "method", *(_column(t).column for t in table.tasks), "avg_retention_pct"]
    )
    for row in table.rows:
        scores = [row.scores.get(task, "") for task in table.tasks]
        writer.writerow(
            [row.model, row.budget_label, row.method, *scores, "" if row.avg is None else row.avg]
        )
    return out.getvalue()


def plot_retention(table: Table, path: str | Path) -> Path:
    """Avg % against the budget, a line per (model, method); the baseline is the line at 100 %."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.axhline(100, color="grey", linestyle="--", linewidth=1, label=table.baseline)
    curves: dict[tuple[str, str], list[tuple[int | float, float]]] = {}
    for row in table.rows:
        if row.method != table.baseline and row.budget is not None and row.avg is not None:
            curves.setdefault((row.model, row.method), []).append((row.budget, row.avg))
    several_models = len({model for model, _ in curves}) > 1
    for i, ((model, method), points) in enumerate(curves.items()):
        budgets, avgs = zip(*sorted(points), strict=True)
        label = f"{model}: {method}" if several_models else method
        ax.plot(budgets, avgs, marker="os^vD<>p"[i % 8], label=label)
    if curves and not several_models:
        ax.set_title(next(iter(curves))[0], fontsize=9)
    ax.set_xlabel("kept visual tokens per image (budget)")
    ax.set_ylabel(f"Avg retention (% of {table.baseline})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(table: Table, directory: str | Path) -> list[Path]:
    """``table.md``, ``table.csv`` and ``retention.png`` in ``directory`` (created); their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    markdown, spreadsheet = directory / "table.md", directory / "table.csv"
    markdown.write_text(to_markdown(table))
    spreadsheet.write_text(to_csv(table))
    return [markdown, spreadsheet, plot_retention(table, directory / "retention.png")]
