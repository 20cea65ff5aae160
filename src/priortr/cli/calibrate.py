"""``priortr calibrate``: label-free, which method, layer and budget keep this model's answers, and what
they save."""

from __future__ import annotations

import argparse
from typing import Any

from priortr import testbed
from priortr.cli import arguments, checks
from priortr.cli.arguments import TESTBED, nonnegative_int, positive_int


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "calibrate",
        help="label-free: which method, layer and budget keep this model's answers",
        description=run.__doc__,
    )
    parser.add_argument("--model", required=True, help=f"hub id, local checkpoint directory, or {TESTBED}")
    parser.add_argument(
        "--data",
        required=True,
        help=f'a folder holding prompts.jsonl (lines {{"image": PATH, "prompt": TEXT}}, paths relative to '
        f"the folder), or a testbed split: {', '.join(testbed.SPLITS)}",
    )
    parser.add_argument(
        "--limit", type=positive_int, help="the first N prompts of a folder, a fixed subset of a split"
    )
    parser.add_argument(
        "--methods", nargs="+", default=["fastv", "priortr"], help="methods of `priortr methods`"
    )
    parser.add_argument(
        "--layers", type=nonnegative_int, nargs="+", default=[2], help="scored layers of one-layer methods"
    )
    parser.add_argument("--budgets", type=arguments.budget, nargs="+", default=[192, 128, 64, 32])
    parser.add_argument("--target", type=float, default=0.95, help="agreement a recommendation must reach")
    parser.add_argument(
        "--rank-by",
        choices=["speedup", "flops"],
        default="speedup",
        help="what fastest means: measured speed-up, or FLOPs share where timings are noisy",
    )
    parser.add_argument("--tokens", type=positive_int, default=4, help="answer tokens compared for agreement")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument(
        "--warmup", type=nonnegative_int, default=1, help="untimed prefills before timing each configuration"
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="timed rounds over the unpruned model and every configuration (quartiles from 5)",
    )
    arguments.add_device_arguments(parser, None, "default: the checkpoint's")
    parser.add_argument("--out", default="calibration", help="folder for results, configs and the cache")
    parser.set_defaults(check=check, run=run)


def check(args: argparse.Namespace) -> None:
    """The grid, the device, the output folder, every prompt (a testbed split resolved here, so the
    library receives plain prompts) and the model, before the model loads."""
    from priortr.frontend import loading
    from priortr.frontend.prompts import check_prompt
    from priortr.tools import calibrate

    checks.distinct("--methods", args.methods)
    checks.distinct("--layers", args.layers)
    checks.distinct("--budgets", args.budgets)
    if not 0.0 < args.target <= 1.0:
        raise ValueError(f"--target {args.target}: an agreement share in (0, 1], e.g. 0.95")
    args.settings = calibrate.grid(args.methods, args.layers, args.budgets)
    checks.device(args)
    args.out = checks.output_directory(args.out)
    if args.data in testbed.SPLITS:
        checks.testbed()
        from priortr.testbed.data import split_prompts

        args.prompts = split_prompts(args.data, args.limit)
    else:
        args.prompts = calibrate.load_prompts(args.data, args.limit)
    args.source = checks.model_source(args.model)
    args.processor = loading.load_processor(args.source)  # the prompts are checked against it now
    for prompt in args.prompts:
        try:
            check_prompt(args.processor, prompt.text)
        except ValueError as exc:
            raise ValueError(f"--data prompt {prompt.id}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """Without labels, how faithful each method x layer x budget stays to the unpruned model on your
    prompts (answer agreement, first-token KL) and what it saves (measured LM prefill speed-up, FLOPs);
    recommends per method the fastest configuration reaching --target and writes it as a config file."""
    from priortr.frontend import loading
    from priortr.tools import calibrate, calibration_report

    processor, model = loading.load(args.source, args.dtype, args.device, processor=args.processor)
    result = calibrate.calibrate(
        model,
        processor,
        args.prompts,  # prompts and grid: from check, before the model load
        args.settings,
        args.out,
        model_name=args.model,
        data_name=args.data,
        target=args.target,
        tokens=args.tokens,
        batch_size=args.batch_size,
        warmup=args.warmup,
        repeats=args.repeats,
        rank_by=args.rank_by,
    )
    paths = calibration_report.write(result, args.out)
    print(calibration_report.to_markdown(result), end="")
    for path in paths:
        print(f"wrote {path}")
    return 0
