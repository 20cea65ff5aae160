"""``priortr report``: the paper's table from lmms-eval result folders."""

from __future__ import annotations

import argparse
from typing import Any

from priortr.cli import checks


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "report", help="the paper's table from lmms-eval results", description=run.__doc__
    )
    parser.add_argument("results", nargs="+", metavar="RESULT_DIR", help="lmms-eval --output_path folders")
    parser.add_argument("--baseline", default="vanilla", help="method label of the unpruned rows")
    parser.add_argument("--out", help="folder for table.md, table.csv and retention.png")
    parser.set_defaults(check=check, run=run)


def check(args: argparse.Namespace) -> None:
    if args.out is not None:
        args.out = checks.output_directory(args.out)


def run(args: argparse.Namespace) -> int:
    """The paper's table from lmms-eval result folders: a row per (model, budget, method), a column per
    benchmark in its own metric, and Avg %: the mean of score / baseline (unpruned) score, x 100."""
    from priortr.tools import report

    table = report.build_table(report.load_runs(args.results), baseline=args.baseline)
    print(report.to_markdown(table), end="")
    for path in report.write(table, args.out) if args.out else []:
        print(f"wrote {path}")
    return 0
