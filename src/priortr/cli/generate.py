"""``priortr generate``: answer a prompt about an image, pruned, and say what was kept and how long the
prefill took."""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from priortr.cli import arguments, checks

if TYPE_CHECKING:
    pass

log = logging.getLogger("priortr.cli")


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("generate", help="answer a prompt about an image", description=run.__doc__)
    arguments.add_model_arguments(parser)
    parser.add_argument("--method", default="priortr", help="a method of `priortr methods`")
    parser.add_argument(
        "--budget", type=arguments.budget, help="kept tokens: count, or ratio in (0, 1) (default 64)"
    )
    arguments.add_layer_arguments(parser)
    parser.add_argument("--config", help=arguments.CONFIG_HELP + "; flags it sets differently are refused")
    parser.add_argument("--max-new-tokens", type=arguments.positive_int, default=32)
    parser.add_argument("--no-prune", action="store_true", help="run the stock model, for comparison")
    parser.set_defaults(check=check, run=run)


def check(args: argparse.Namespace) -> None:
    if args.stages and (args.budget is not None or args.layer is not None):
        given = " and ".join(
            o for o, v in (("--budget", args.budget), ("--layer", args.layer)) if v is not None
        )
        raise ValueError(f"--stages sets each stage's layer and budget; drop {given} or drop --stages")
    model = checks.one_image_model(args)
    checks.check_pruning(model, **arguments.pruning_arguments(args))


def run(args: argparse.Namespace) -> int:
    """Answer ``--prompt`` about ``--image`` with greedy decoding, pruned unless ``--no-prune``."""
    import torch

    import priortr
    from priortr.frontend import loading, timing
    from priortr.frontend.prompts import chat_inputs

    log.info("loading %s (dtype %s) onto %s", args.model, args.dtype or "auto", args.device)
    processor, model = loading.load(args.source, args.dtype, args.device, processor=args.processor)
    inputs = chat_inputs(processor, args.loaded_image, args.prompt, model)
    pruning = (
        contextlib.nullcontext()
        if args.no_prune
        else priortr.apply(model, **arguments.pruning_arguments(args))
    )
    with pruning as handle, torch.inference_mode():
        with timing.forward_calls_ms(model) as calls:
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        last = handle.last if handle is not None else None
    n_prompt = inputs["input_ids"].shape[1]
    print(processor.decode(out[0, n_prompt:], skip_special_tokens=True).strip())
    if handle is None:
        print("visual tokens kept: all (pruning off, --no-prune)")
    elif last is None:
        print("visual tokens kept: all (the prompt had nothing to prune)")
    else:
        print(f"visual tokens kept: {int((last.kept[0] >= 0).sum())} / {int(last.n_visual[0])}")
    print(f"prefill: {calls[0]:.1f} ms")
    return 0
