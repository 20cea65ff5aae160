"""``priortr bench``: measure prefill, KV cache and throughput of vanilla and each method x budget x
batch size, recording each measurement as it finishes."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from priortr.cli import arguments, checks
from priortr.cli.arguments import nonnegative_int, positive_int
from priortr.frontend.loading import ATTENTION


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "bench", help="measure prefill, KV cache and throughput", description=run.__doc__
    )
    parser.add_argument("--model", default="llava-1.5-7b", help="shipped config name or checkpoint directory")
    parser.add_argument(
        "--layers", type=positive_int, help="cut the language model to this many decoder layers"
    )
    parser.add_argument("--vision-layers", type=positive_int, help="cut the vision tower to this many layers")
    parser.add_argument("--methods", nargs="+", help="default: vanilla and every method")
    parser.add_argument("--budgets", type=positive_int, nargs="+", default=[192, 128, 64])
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--layer", type=nonnegative_int, help=arguments.layer_help())
    parser.add_argument(
        "--option", type=arguments.parse_option, action="append", help="a method's knob, name=value"
    )
    parser.add_argument("--text-tokens", type=positive_int, default=48, help="text tokens around the image")
    parser.add_argument(
        "--new-tokens", type=positive_int, default=32, help="greedy tokens generated per sample"
    )
    parser.add_argument("--warmup", type=nonnegative_int, default=3)
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=10,
        help="timed prefill runs per configuration (quartiles from 5)",
    )
    parser.add_argument(
        "--decode-repeats", type=positive_int, default=3, help="timed generate() runs per configuration"
    )
    arguments.add_device_arguments(parser, None, "default: bfloat16 when CUDA is available, else float32")
    parser.add_argument("--attn", choices=ATTENTION, default="sdpa", help="attention implementation")
    parser.add_argument(
        "--out", default="bench-out", help="folder for bench.jsonl (each measurement), bench.json, .md, .png"
    )
    parser.add_argument("--resume", action="store_true", help="continue the run recorded in --out")
    parser.add_argument(
        "--config", help=arguments.CONFIG_HELP + "; vanilla against it, replacing the grid flags"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.set_defaults(check=check, run=run)


def check(args: argparse.Namespace) -> None:
    import torch

    import priortr
    from priortr.tools import bench

    if args.config:
        setting = arguments.config_setting(args, "bench")
        args.methods, args.budgets = [bench.VANILLA, setting["method"]], [setting["budget"]]
        args.layer, args.option = setting["layer"], list((setting["options"] or {}).items())
    checks.distinct("--methods", args.methods)
    checks.distinct("--budgets", args.budgets)
    checks.distinct("--batch-sizes", args.batch_sizes)
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    device = checks.device(args)
    if args.attn == "flash_attention_2" and device.type != "cuda":
        raise ValueError("--attn flash_attention_2 runs on CUDA only; use sdpa or eager")
    args.out = checks.output_directory(args.out)
    model = checks.skeleton(bench.bench_config(args.model, args.layers, args.vision_layers))
    for method in args.methods or [bench.VANILLA, *priortr.available_methods()]:
        if method == bench.VANILLA:
            continue
        layer = args.layer if priortr.get_method(method).where == "layer" else None
        for budget in args.budgets:
            checks.check_pruning(
                model, method=method, budget=budget, layer=layer, options=dict(args.option or [])
            )


def run(args: argparse.Namespace) -> int:
    """Measure prefill, KV cache and throughput for vanilla and each method x budget x batch size;
    every measurement is recorded as it finishes (``bench.jsonl``, read back by ``--resume``)."""
    import torch
    from tqdm import tqdm

    import priortr
    from priortr.frontend.loading import torch_dtype
    from priortr.tools import bench
    from priortr.tools.journal import Journal, finished_so_far, write_whole

    out = Path(args.out)
    settings = {
        key: getattr(args, key)
        for key in ("model", "layers", "vision_layers", "layer", "option", "text_tokens", "new_tokens")
    }
    settings.update(device=args.device, dtype=args.dtype, attn=args.attn)
    settings["option"] = [list(option) for option in args.option or []]
    with Journal(out / "bench.jsonl", settings, args.resume) as journal:
        model = bench.build_model(
            args.model,
            torch.device(args.device),
            torch_dtype(args.dtype),
            args.layers,
            args.vision_layers,
            args.attn,
        )
        runner = bench.Bench(
            model,
            args.methods or [bench.VANILLA, *priortr.available_methods()],
            args.budgets,
            args.batch_sizes,
            layer=args.layer,
            options=dict(args.option or []),
            text_tokens=args.text_tokens,
            new_tokens=args.new_tokens,
            warmup=args.warmup,
            repeats=args.repeats,
            decode_repeats=args.decode_repeats,
            meta={"model": args.model, "command": "priortr " + " ".join(args.argv)},
            journal=journal,
        )
        with finished_so_far(lambda: bench.format_markdown(runner.report()), journal.path):
            runner.run(lambda steps: tqdm(list(steps), desc="bench", unit="run", file=sys.stderr))
        report = runner.report()
        report.meta["peak_rss_bytes"] = bench.peak_rss_bytes()
        document = report.to_json()
        write_whole(out / "bench.json", lambda path: path.write_text(json.dumps(document, indent=2)))
        write_whole(out / "bench.md", lambda path: path.write_text(bench.format_markdown(report)))
        if importlib.util.find_spec("matplotlib") is None:
            # the accelerator image may lack it (scripts/gpu-check.sh): every number is in json and md
            print(
                f"note: {out / 'bench.png'} not drawn: matplotlib is not installed "
                "(pip install matplotlib); bench.json and bench.md hold every number",
                file=sys.stderr,
            )
        else:
            write_whole(out / "bench.png", lambda path: bench.plot(report, path))
    print(json.dumps(document) if args.json else bench.format_markdown(report))
    return 0
