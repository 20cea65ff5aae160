"""``priortr demo``: the trained testbed, full model vs FastV vs PriorTR, at its calibrated setting."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from priortr.cli import arguments, checks
from priortr.cli.arguments import nonnegative_int, positive_int
from priortr.frontend import loading


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "demo", help="the trained testbed: full model vs FastV vs PriorTR", description=run.__doc__
    )
    parser.add_argument(
        "--budget", type=positive_int, help="visual tokens kept of 576 (default: the calibrated one)"
    )
    parser.add_argument(
        "--layer", type=nonnegative_int, help="0-indexed scored decoder layer (default: the calibrated one)"
    )
    parser.add_argument(
        "--config", help=arguments.CONFIG_HELP + "; its layer and budget replace the calibrated ones"
    )
    parser.add_argument("--out", default="priortr-demo.png", help="path of the PNG to write")
    parser.add_argument(
        "--save-image", metavar="PATH", help="only save the demo's scene image (to try generate and viz on)"
    )
    parser.set_defaults(check=check, run=run)


def check(args: argparse.Namespace) -> None:
    checks.testbed()
    from priortr.testbed import demo
    from priortr.testbed.assemble import checkpoint

    if args.save_image is not None:  # only the scene image: no model
        args.save_image = checks.output_file(args.save_image, "--save-image", (".png", ".jpg"))
        return
    args.out = checks.output_file(args.out)
    chosen = demo.setting(args.config, args.layer, args.budget)
    model = checks.skeleton(loading.model_config(str(checkpoint())))
    for method in demo.METHODS:
        checks.check_pruning(model, method=method, budget=chosen["budget"], layer=chosen["layer"])


def run(args: argparse.Namespace) -> int:
    """The trained testbed on a fixed set of held-out scenes at the setting its calibration chose: per
    method (full model, FastV, PriorTR) the answers right, the agreement with the full model and the
    measured LM prefill time; then a PNG of prior, posterior, score and kept tokens for one question."""
    from priortr.testbed import demo

    sample = demo.demo_sample()
    if args.save_image is not None:
        sample.image().save(args.save_image)
        print(f"{args.save_image}: scene {sample.image_id}, e.g. --prompt {sample.question!r}")
        return 0
    start = time.perf_counter()
    chosen = demo.setting(args.config, args.layer, args.budget)
    layer, budget = chosen["layer"], chosen["budget"]
    model, processor = demo.load()
    samples = demo.demo_samples()
    source = args.config or f"calibrated on scenes-train, {demo.CALIBRATED.name}"
    if args.layer is not None or args.budget is not None:
        source = f"--layer/--budget over {source}"
    print(
        f"{len(samples)} held-out scenes (seeded generator), one question each; layer {layer}, "
        f"K = {budget} of {model.config.image_seq_length} visual tokens ({source})"
    )
    rows = demo.compare(model, processor, samples, budget, layer)
    print(f"  {'method':<8} {'right':>7} {'agrees':>7} {'speed-up':>10} {'FLOPs':>6}  LM prefill ms")
    for row in rows:
        print(
            f"  {row.method:<8} {row.correct:>3}/{row.total:<3} {row.agreement:>7.0%} {speedup(row):>10} "
            f"{row.flops_share:>6.3f}  {row.lm_prefill}"
        )
    for row in rows:
        if row.timing is not None and not row.timing.resolved:
            print(
                f"warning: {row.method}: the LM prefill medians differ by less than the spread of the "
                f"timings, so its speed-up {row.timing.speedup:.2f}x is noise here (another process?); "
                f"its FLOPs share, {row.flops_share:.3f}, is what pruning saves"
            )
    print(f"maps for scene {sample.image_id}: {sample.question} (reference answer: {sample.answer})")
    print(demo.figure(model, processor, sample, sample.image(), budget, layer, Path(args.out)))
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


def speedup(row: Any) -> str:
    """A method's speed-up over the unpruned model, ``(!)`` where the timings do not resolve it."""
    if row.timing is None:
        return "-"
    return f"{row.timing.speedup:.2f}x" + ("" if row.timing.resolved else " (!)")
