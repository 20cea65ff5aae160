"""``priortr flops``: analytic FLOPs per term of vanilla and each method (the paper's own FLOPs column is
reproduced by ``benchmarks/paper_flops.py`` in the repository)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from priortr.cli import arguments, checks
from priortr.cli.arguments import nonnegative_int, positive_int


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("flops", help="analytic FLOPs per term", description=run.__doc__)
    parser.add_argument("--model", default="llava-1.5-7b", help="shipped config name or checkpoint directory")
    parser.add_argument("--budgets", type=arguments.budget, nargs="+", default=[192, 128, 64])
    parser.add_argument(
        "--methods", nargs="+", default=["priortr"], help="methods to count (`priortr methods` lists them)"
    )
    parser.add_argument(
        "--layer",
        type=nonnegative_int,
        help="0-indexed decoder layer whose attention is scored (default: each method's own)",
    )
    parser.add_argument("--text-tokens", type=positive_int, default=48)
    parser.add_argument("--decode-steps", type=nonnegative_int, default=63)
    parser.add_argument(
        "--image-tokens", type=positive_int, help="visual tokens per image (default: the model's)"
    )
    parser.add_argument("--exact", action="store_true", help="count grouped-query K/V projections exactly")
    parser.add_argument(
        "--config", help=arguments.CONFIG_HELP + "; replaces --methods, --budgets and --layer"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.set_defaults(check=check, run=run)


def check(args: argparse.Namespace) -> None:
    if args.config:
        setting = arguments.config_setting(args, "flops")
        if setting["options"]:
            raise ValueError(
                f"priortr flops counts each method at its default options, and {args.config!r} "
                f"sets options {setting['options']!r} for {setting['method']}; measure that setting "
                f"with `priortr bench --config {args.config}`"
            )
        args.methods, args.budgets = [setting["method"]], [setting["budget"]]
        args.layer = args.layer if setting["layer"] is None else setting["layer"]
    checks.distinct("--budgets", args.budgets)
    checks.distinct("--methods", args.methods)


def run(args: argparse.Namespace) -> int:
    """Analytic FLOPs (the paper's protocol, Appendix "Efficiency Analysis") of vanilla and each method."""
    from priortr.tools import flops

    report = flops.flops_report(
        args.model,
        args.budgets,
        methods=args.methods,
        layer=args.layer,
        text_tokens=args.text_tokens,
        decode_steps=args.decode_steps,
        image_tokens=args.image_tokens,
        exact=args.exact,
    )
    print(json.dumps(report) if args.json else flops.format_table(report))
    return 0
