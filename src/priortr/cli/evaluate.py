"""``priortr eval``: accuracy of the methods x budgets on a testbed question split."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from priortr import testbed
from priortr.cli import arguments, checks
from priortr.cli.arguments import TESTBED, nonnegative_int, positive_int

log = logging.getLogger("priortr.cli")


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "eval", help="accuracy under pruning, methods x budgets", description=run.__doc__
    )
    parser.add_argument("--split", choices=testbed.SPLITS, default="scenes-test")
    parser.add_argument("--limit", type=positive_int, help="a fixed random subset of this many questions")
    parser.add_argument("--model", default=TESTBED, help=f"{TESTBED}, or a checkpoint with a chat template")
    parser.add_argument("--methods", nargs="+", default=list(testbed.DEFAULT_METHODS))
    parser.add_argument("--budgets", type=positive_int, nargs="+", default=list(testbed.DEFAULT_BUDGETS))
    parser.add_argument(
        "--layer",
        type=nonnegative_int,
        help="0-indexed decoder layer scored by one-layer methods (default: each method's own)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=8)
    arguments.add_device_arguments(parser, "float32", None)
    parser.add_argument(
        "--config", help=arguments.CONFIG_HELP + "; vanilla against it, replacing the grid flags"
    )
    parser.add_argument(
        "--out", default="eval-out", help="folder for <split>.samples.jsonl (every answer), .json, .md, .png"
    )
    parser.add_argument("--resume", action="store_true", help="continue the run recorded in --out")
    parser.set_defaults(check=check, run=run)


def check(args: argparse.Namespace) -> None:
    checks.testbed()
    from priortr.frontend import loading
    from priortr.testbed.evaluate import layer_for

    args.options = None
    if args.config:
        setting = arguments.config_setting(args, "eval")
        args.methods, args.budgets = [testbed.VANILLA, setting["method"]], [setting["budget"]]
        args.layer = args.layer if setting["layer"] is None else setting["layer"]
        args.options = setting["options"]
    checks.distinct("--methods", args.methods)
    checks.distinct("--budgets", args.budgets)
    checks.device(args)
    args.out = checks.output_directory(args.out)
    args.source = checks.model_source(args.model)
    model = checks.skeleton(loading.model_config(args.source))
    for method in args.methods:
        for budget in [] if method == testbed.VANILLA else args.budgets:
            checks.check_pruning(
                model,
                method=method,
                budget=budget,
                layer=layer_for(method, args.layer),
                options=args.options,
                strict=True,
            )


def run(args: argparse.Namespace) -> int:
    """Accuracy on a named split for methods x budgets; writes every answer as it comes
    (``<split>.samples.jsonl``, read back by ``--resume``), then JSON, a markdown table and a retention
    plot."""
    from priortr.frontend import loading
    from priortr.testbed import data, evaluate
    from priortr.tools.journal import Journal, finished_so_far

    samples = data.load_split(args.split, args.limit)
    settings = {"split": args.split, "limit": args.limit, "model": args.model, "layer": args.layer}
    settings["dtype"] = args.dtype
    if args.options:  # only when set, so that records made before options were recorded still resume
        settings["options"] = args.options
    with Journal(Path(args.out) / f"{args.split}.samples.jsonl", settings, args.resume) as journal:
        processor, model = loading.load(args.source, args.dtype, args.device)
        evaluation = evaluate.Evaluation(
            model,
            processor,
            samples,
            args.split,
            args.methods,
            args.budgets,
            args.layer,
            args.model,
            journal,
            args.options,
        )
        with finished_so_far(lambda: evaluation.report().to_markdown(), journal.path):
            evaluation.run(args.batch_size)
        report = evaluation.report()
        for path in report.write(args.out, args.split):
            log.info("wrote %s", path)
    print(report.to_markdown())
    print(f"wrote {args.out}/{args.split}.{{samples.jsonl,json,md,png}}")
    return 0
