"""``priortr viz``: draw the prior Q, posterior P, score S and kept tokens over the image."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from priortr.cli import arguments, checks
from priortr.cli.arguments import nonnegative_int

log = logging.getLogger("priortr.cli")


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "viz", help="draw prior, posterior and score maps over the image", description=run.__doc__
    )
    arguments.add_model_arguments(parser)
    parser.add_argument("--method", default="priortr", help="a scoring-rule method of `priortr methods`")
    parser.add_argument(
        "--layers", type=nonnegative_int, nargs="+", default=[2], help="0-indexed scored layers, a row each"
    )
    parser.add_argument(
        "--budgets",
        type=arguments.budget,
        nargs="+",
        default=[64],
        help="kept tokens: counts or ratios, a row each",
    )
    parser.add_argument(
        "--config", help=arguments.CONFIG_HELP + "; replaces --method, --budgets and --layers"
    )
    parser.add_argument("--out", required=True, help="path of the PNG to write (.png added if no suffix)")
    parser.set_defaults(check=check, run=run)


def check(args: argparse.Namespace) -> None:
    import priortr

    if args.config:
        setting = arguments.config_setting(args, "viz", ("method", "budget", "layer"))
        args.method, args.budgets = setting["method"], [setting["budget"]]
        args.layers = args.layers if setting["layer"] is None else [setting["layer"]]
    checks.distinct("--layers", args.layers)
    checks.distinct("--budgets", args.budgets)
    args.out = checks.output_file(args.out)
    drawable = [
        name
        for name in priortr.available_methods()
        if priortr.get_method(name).where == "layer" and "attention" in priortr.get_method(name).needs
    ]
    priortr.get_method(args.method)  # an unknown name is refused with the list of methods
    if args.method not in drawable:
        raise ValueError(
            f"--method {args.method} does not score prior and posterior attention after one decoder layer, "
            f"so there are no maps to draw; use one of {', '.join(drawable)}"
        )
    model = checks.one_image_model(args)
    for layer in args.layers:
        for budget in args.budgets:
            checks.check_pruning(model, method=args.method, budget=budget, layer=layer)


def run(args: argparse.Namespace) -> int:
    """Draw the prior Q, posterior P, score S and kept tokens over the image, one row per layer x budget
    (the paper's qualitative figure)."""
    from priortr.adapters import adapter_for
    from priortr.frontend import loading
    from priortr.tools import families, viz

    image = args.loaded_image
    log.info("loading %s (dtype %s) onto %s", args.model, args.dtype or "auto", args.device)
    processor, model = loading.load(args.source, args.dtype, args.device, processor=args.processor)
    results = viz.attention_maps(
        model, processor, image, args.prompt, layers=args.layers, budgets=args.budgets, method=args.method
    )
    view = families.image_view(adapter_for(model), image, processor)
    title = f'{Path(args.model).name or args.model}, {args.method}: "{args.prompt}"'
    print(viz.render(results, view, args.out, title=title))
    for maps in results:
        print(
            f"layer {maps.layer}, budget {maps.budget}: visual tokens kept: {maps.n_kept} / {maps.n_visual}"
        )
    return 0
