"""``priortr report``: the paper's table from lmms-eval results files, written here by hand.

Expected values are computed by hand in the comments; the paper's own LLaVA-1.5-7B numbers
(``benchmarks/reference/paper-accuracy-llava15-7b.csv``) are turned into results
files with a conversion written here, independently of ``report.PAPER_BENCHMARKS``, and must give back
the paper's cells and its Avg column.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from priortr.cli import main
from priortr.tools import report

PAPER_CSV = Path(__file__).resolve().parents[2] / "benchmarks" / "reference" / "paper-accuracy-llava15-7b.csv"
MODEL = "llava-hf/llava-1.5-7b-hf"


def write_result(
    folder: Path,
    tasks: dict[str, dict[str, float]],
    *,
    method: str = "priortr",
    budget: int | float = 64,
    kept_ratio: float | None = 0.25,
    visual_tokens: float | None = 576,
    model: str = MODEL,
    lmms_model: str = "priortr",
) -> Path:
    """One results file as lmms-eval 0.7 lays it out: ``folder/<model>/<date>_results.json``."""
    throughput = {"total_gen_tokens": 10, "avg_budget": budget}
    if kept_ratio is not None:
        throughput["avg_kept_ratio"] = kept_ratio
    if visual_tokens is not None:
        throughput["avg_visual_tokens"] = visual_tokens
    model_args = f"pretrained={model}" + (
        f",method={method},budget={budget}" if lmms_model == "priortr" else ""
    )
    data = {
        "results": {task: {"alias": task, **metrics} for task, metrics in tasks.items()},
        "config": {"model": lmms_model, "model_args": model_args},
        "throughput": throughput,
    }
    path = folder / model.replace("/", "__") / "20260101_000000_results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def _scores(gqa: float, perception: float, cognition: float, mine: float) -> dict[str, dict[str, float]]:
    return {
        "gqa": {"exact_match,none": gqa, "exact_match_stderr,none": 0.01},
        "mme": {"mme_perception_score,none": perception, "mme_cognition_score,none": cognition},
        "mytask": {"acc,none": mine, "acc_stderr,none": 0.1},
    }


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """Vanilla (budget=576, every token kept) split over two runs; priortr at 128 and 64; fastv at 64."""
    root = tmp_path / "results"
    vanilla = _scores(0.60, 1500, 300, 0.5)
    write_result(root / "vanilla-gqa", {"gqa": vanilla["gqa"]}, budget=576, kept_ratio=1.0)
    rest = {"mme": vanilla["mme"], "mytask": vanilla["mytask"]}
    write_result(root / "vanilla-rest", rest, budget=576, kept_ratio=1.0)
    write_result(root / "priortr-128", _scores(0.57, 1450, 350, 0.5), budget=128, kept_ratio=128 / 576)
    write_result(root / "priortr-64", _scores(0.54, 1300, 320, 0.4))
    write_result(root / "fastv-64", _scores(0.30, 700, 200, 0.25), method="fastv")
    return root


def test_table_scores_and_avg_by_hand(results: Path) -> None:
    table = report.build_table(report.load_runs([results]))
    assert table.tasks == ["gqa", "mme", "mytask"]  # the paper's order, then other tasks by name
    assert [(row.method, row.budget) for row in table.rows] == [
        ("vanilla", None),
        ("priortr", 128),
        ("fastv", 64),
        ("priortr", 64),
    ]
    vanilla, p128, fastv, p64 = table.rows
    assert vanilla.scores == pytest.approx({"gqa": 60.0, "mme": 1800.0, "mytask": 0.5})
    # priortr 64: 54/60 = 0.9, 1620/1800 = 0.9, 0.4/0.5 = 0.8 -> 86.67 %
    assert p64.avg == pytest.approx(100 * (0.9 + 0.9 + 0.8) / 3)
    # priortr 128: 57/60 = 0.95, 1800/1800 = 1, 0.5/0.5 = 1 -> 98.33 %; fastv 64: 0.5 each -> 50 %
    assert p128.avg == pytest.approx(100 * (0.95 + 1 + 1) / 3)
    assert fastv.avg == pytest.approx(50.0)
    assert vanilla.avg == pytest.approx(100.0)

    markdown = report.to_markdown(table)
    assert "| model | budget | method | GQA | MME | mytask | Avg % |" in markdown
    assert f"| {MODEL} | 576 | vanilla | 60.0 | 1800 | 0.500 | 100.0 |" in markdown
    assert f"| {MODEL} | 64 | priortr | 54.0 | 1620 | 0.400 | 86.7 |" in markdown
    assert f"| {MODEL} | 128 | priortr | 57.0 | 1800 | 0.500 | 98.3 |" in markdown
    assert "*:" not in markdown  # every row has every benchmark

    rows = list(csv.DictReader(io.StringIO(report.to_csv(table))))
    assert [row["method"] for row in rows] == ["vanilla", "priortr", "fastv", "priortr"]
    assert float(rows[3]["avg_retention_pct"]) == pytest.approx(86.6666666, rel=1e-6)
    assert float(rows[3]["MME"]) == 1620.0 and rows[0]["budget"] == "576"


def test_a_row_without_every_benchmark_is_averaged_over_its_own(results: Path) -> None:
    write_result(
        results / "priortr-32", {"gqa": {"exact_match,none": 0.48}, "zero": {"acc,none": 0.1}}, budget=32
    )
    write_result(results / "vanilla-zero", {"zero": {"acc,none": 0.0}}, budget=576, kept_ratio=1.0)
    other = {"model": "other", "lmms_model": "llava_hf", "kept_ratio": None, "visual_tokens": None}
    write_result(results / "llava-hf", {"gqa": {"exact_match,none": 0.5}}, **other)
    table = report.build_table(report.load_runs([results]))
    p32 = next(row for row in table.rows if row.budget == 32)
    assert p32.avg == pytest.approx(80.0)  # 48 / 60: GQA only, a baseline score of 0 has no retention
    markdown = report.to_markdown(table)
    assert f"| {MODEL} | 32 | priortr | 48.0 | - | - | 0.100 | 80.0* |" in markdown
    assert f"| {MODEL} | 576 | vanilla | 60.0 | 1800 | 0.500 | 0.000 | 100.0* |" in markdown
    assert "*: over the benchmarks that row has" in markdown
    # another lmms-eval model is that model's unpruned row; no throughput log: its budget is "all"
    assert "| other | all | vanilla | 50.0 | - | - | - | 100.0* |" in markdown


def test_a_group_entry_without_metrics_is_not_a_column(results: Path) -> None:
    """Negative control for the refusals below: lmms-eval's group entries hold an alias and no metric."""
    path = next((results / "priortr-64").rglob("*_results.json"))
    data = json.loads(path.read_text())
    data["results"]["mmbench"] = {"alias": "mmbench", "acc_stderr,none": "N/A"}
    path.write_text(json.dumps(data))
    assert report.build_table(report.load_runs([results])).tasks == ["gqa", "mme", "mytask"]


def test_cli_writes_markdown_csv_and_plot(results: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "table"
    assert main(["report", str(results), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"| {MODEL} | 64 | priortr | 54.0 | 1620 | 0.400 | 86.7 |" in printed
    assert (out / "table.md").read_text() in printed
    assert (
        (out / "table.csv").read_text().startswith("model,budget,method,GQA,MME,mytask,avg_retention_pct\n")
    )
    assert (out / "retention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_another_baseline_can_be_named(results: Path) -> None:
    table = report.build_table(report.load_runs([results / "fastv-64", results / "priortr-64"]), "fastv")
    assert [row.avg for row in table.rows] == pytest.approx(
        [100.0, 100 * (54 / 30 + 1620 / 900 + 0.4 / 0.25) / 3]
    )


BAD_CELLS = {  # how each bad results file differs from a good one
    "boolean score": lambda data: data["results"]["gqa"].update({"exact_match,none": True}),
    "NaN score": lambda data: data["results"]["gqa"].update({"exact_match,none": float("nan")}),
    "infinite score": lambda data: data["results"].update({"mytask": {"acc,none": float("inf")}}),
    "text metric": lambda data: data["results"].update({"mytask": {"alias": "mytask", "acc,none": "N/A"}}),
    "bare number": lambda data: data["results"].update({"gqa": 0.5}),
    "NaN budget": lambda data: data["config"].update({"model_args": f"pretrained={MODEL},budget=nan"}),
}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("empty folder", r"no lmms-eval results \(\*_results.json\) in this folder or below"),
        ("no vanilla", r"no 'vanilla' run of llava-hf/llava-1.5-7b-hf among the results \(methods found: "),
        ("task without baseline", r"priortr at budget 64 has pope but the 'vanilla' run does not"),
        (
            "same cell twice",
            r"gqa of llava-hf/llava-1.5-7b-hf, priortr at budget 64, is in two results files",
        ),
        ("not json", r"not a readable lmms-eval results JSON"),
        ("no such folder", r"no such file or folder"),
        # before: True counted as 100.0 (an Avg of 130 %)
        ("boolean score", r"bad_results.json: task gqa, metric exact_match,none is True, not a finite"),
        # before: NaN and infinity went into the table and the Avg
        ("NaN score", r"task gqa, metric exact_match,none is nan, not a finite number"),
        ("infinite score", r"task mytask, metric acc,none is inf, not a finite number"),
        # before: the column of a task outside the paper's table vanished
        ("text metric", r"task mytask, metric acc,none is 'N/A', not a finite number"),
        # before: a traceback
        ("bare number", r"results of task gqa is 0.5, not an object of metrics"),
        ("NaN budget", r"budget='nan' in model_args is not a finite number"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    results: Path, tmp_path: Path, case: str, message: str, capsys
) -> None:
    paths = [results]
    if case == "empty folder":
        (tmp_path / "empty").mkdir()
        paths = [tmp_path / "empty"]
    elif case == "no vanilla":
        paths = [results / "priortr-64", results / "fastv-64"]
    elif case == "task without baseline":
        write_result(results / "pope", {"pope": {"pope_f1_score,none": 0.8}})
    elif case == "same cell twice":
        write_result(results / "rerun", {"gqa": {"exact_match,none": 0.55}})
    elif case == "not json":
        (results / "broken_results.json").write_text("{")
    elif case in BAD_CELLS:
        path = write_result(results / "bad", {"gqa": {"exact_match,none": 0.5}}, budget=32)
        data = json.loads(path.read_text())
        BAD_CELLS[case](data)
        path.unlink()
        (path.parent / "bad_results.json").write_text(json.dumps(data))
    else:
        paths = [tmp_path / "missing"]
    with pytest.raises(report.ReportError, match=message):
        report.build_table(report.load_runs(paths))
    assert main(["report", *map(str, paths)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("priortr: error: ") and err.count("\n") == 1 and "Traceback" not in err


# -- the paper's numbers -----------------------------------------------------------------------------

# paper column -> (lmms-eval task, results.json key, paper number / key value), from docs/lmms-eval.md
TO_LMMS_EVAL = {
    "GQA": ("gqa", "exact_match,none", 100),
    "POPE": ("pope", "pope_f1_score,none", 100),
    "MMB": ("mmbench_en_dev", "gpt_eval_score,none", 1),
    "TextVQA": ("textvqa_val", "exact_match,none", 100),
    "SEED": ("seedbench", "seed_image,none", 100),
    "VizWiz": ("vizwiz_vqa_val", "exact_match,none", 100),
    "SQA": ("scienceqa_img", "exact_match,none", 100),
    "Flickr": ("flickr30k_test", "flickr_CIDEr,none", 100),
    "NoCaps": ("nocaps_val", "nocaps_CIDEr,none", 1),
    "OKVQA": ("ok_vqa_val2014", "exact_match,none", 100),
    "MMVet": ("mmvet", "gpt_eval_score,none", 1),
}


def _paper_rows() -> list[dict[str, str]]:
    assert PAPER_CSV.is_file(), f"the paper's table is expected at {PAPER_CSV} (benchmarks/reference/)"
    lines = [line for line in PAPER_CSV.read_text().splitlines() if line and not line.startswith("#")]
    return list(csv.DictReader(lines))


def _paper_tasks(row: dict[str, str]) -> dict[str, dict[str, float]]:
    """One CSV row as lmms-eval task results, in lmms-eval's own scales."""
    tasks = {task: {key: float(row[column]) / scale} for column, (task, key, scale) in TO_LMMS_EVAL.items()}
    mme = float(row["MME"])  # MME = perception + cognition; any split gives the same sum
    tasks["mme"] = {"mme_perception_score,none": mme - 250, "mme_cognition_score,none": 250}
    return tasks


def test_paper_avg_column_is_reproduced_from_its_own_numbers(tmp_path: Path) -> None:
    paper = _paper_rows()
    assert len(paper) == 19 and paper[0]["method"] == "vanilla"
    for row in paper:  # one lmms-eval run per task, as docs/lmms-eval.md loops them
        unpruned = row["method"] == "vanilla"
        for task, metrics in _paper_tasks(row).items():
            write_result(
                tmp_path / f"{row['method']}-{row['budget']}" / task,
                {task: metrics},
                method="priortr" if unpruned else row["method"],
                budget=int(row["budget"]),
                kept_ratio=1.0 if unpruned else int(row["budget"]) / 576,
            )
    table = report.build_table(report.load_runs([tmp_path]))
    assert len(table.rows) == 19 and len(table.tasks) == 12
    by_key = {(row.method, row.budget_label): row for row in table.rows}
    for row in paper:
        mine = by_key[(row["method"], row["budget"])]
        for task in table.tasks:
            column = report.PAPER_BENCHMARKS[task].column
            assert mine.scores[task] == pytest.approx(float(row[column]), rel=1e-12), (row["method"], column)
        # the paper prints Avg to one decimal: ours must round to it
        assert abs(mine.avg - float(row["Avg"])) <= 0.05 + 1e-9, (row["method"], row["budget"], mine.avg)
    markdown = report.to_markdown(table)
    assert (
        f"| {MODEL} | 64 | priortr | 56.6 | 76.3 | 1745 | 61.2 | 54.9 | 60.1 | 51.5 | 68.8 | 71.2 | 1.01 |"
        in markdown
    )
