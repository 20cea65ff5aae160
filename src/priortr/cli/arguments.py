"""What the command-line flags are: argparse types, the flags several commands share, and how pruning
flags become ``priortr.apply`` keywords.

Imports nothing heavy (no torch), so that ``priortr --help`` answers at once.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections.abc import Callable
from typing import Any

from priortr.config_file import parse_budget
from priortr.frontend.loading import DTYPES

TESTBED = "testbed"  # --model name of the trained testbed (priortr.testbed), assembled on first use
CONFIG_HELP = "a config file of priortr.apply keywords, e.g. recommended.json of `priortr calibrate`"
DEVICE_HELP = "cpu, cuda, cuda:N or mps (default: cuda when available, else cpu)"


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def budget(text: str) -> int | float:
    """A budget flag: a token count or a ratio (``config_file.parse_budget``); the API checks the range."""
    try:
        return parse_budget(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_option(text: str) -> tuple[str, Any]:
    """``name=value`` with a Python or JSON literal value (``neighbours=8``, ``adaptive=True``,
    ``adaptive=true``), or a plain string."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"an option is name=value, got {text!r}")
    value = value.strip()
    try:
        return name.strip(), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        pass
    try:
        return name.strip(), json.loads(value)
    except json.JSONDecodeError:
        return name.strip(), value


def parse_stage(text: str) -> tuple[int, int | float]:
    """``layer:budget``, e.g. ``7:288``."""
    layer, sep, value = text.partition(":")
    if not sep or not re.fullmatch(r"[+-]?\d+", layer.strip()):
        raise argparse.ArgumentTypeError(f"a stage is layer:budget (e.g. 7:288), got {text!r}")
    if int(layer) < 0:
        raise argparse.ArgumentTypeError(f"a stage's layer is a decoder layer index >= 0, got {text!r}")
    return int(layer), budget(value)


def add_device_arguments(parser: argparse.ArgumentParser, dtype_default: str | None, dtype_help: str) -> None:
    """``--device`` (resolved by the command's check, so that building the parser needs no torch) and
    ``--dtype``."""
    parser.add_argument("--device", default=None, help=DEVICE_HELP)
    parser.add_argument("--dtype", choices=list(DTYPES), default=dtype_default, help=dtype_help)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--image``, ``--prompt``, ``--device``, ``--dtype``: one real prompt on a checkpoint."""
    parser.add_argument(
        "--model",
        required=True,
        help=f"hub id, local checkpoint directory, or {TESTBED} (the trained testbed)",
    )
    parser.add_argument("--image", required=True, help="path of the image file")
    parser.add_argument("--prompt", required=True, help="the question or instruction")
    add_device_arguments(parser, None, "default: the checkpoint's")


def layer_help() -> str:
    """``--layer``'s help: the layer each method scores when none is given (from the method catalog)."""
    from priortr.cli.methods import default_layers

    default = f"the method's own, {default_layers()}"
    return f"0-indexed decoder layer scored by one-layer methods (default: {default})"


def add_layer_arguments(parser: argparse.ArgumentParser) -> None:
    """``--layer``, ``--stages`` and ``--option``: where and how a method prunes."""
    parser.add_argument("--layer", type=nonnegative_int, help=layer_help())
    parser.add_argument(
        "--stages",
        type=parse_stage,
        nargs="+",
        help="explicit stages layer:budget (e.g. 7:288 15:144), instead of --budget and --layer",
    )
    parser.add_argument("--option", type=parse_option, action="append", help="a method's knob, name=value")


def pruning_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The ``priortr.apply`` keywords shared by the commands that prune; with ``--config``, the file's
    (``priortr.apply`` refuses a flag that the file sets differently)."""
    arguments = {
        "method": args.method,
        "budget": args.budget,
        "layer": args.layer,
        "stages": args.stages,
        "options": dict(args.option) if args.option else None,  # None: a --config file may set them
    }
    return {**arguments, "config": args.config} if args.config else arguments


def config_setting(
    args: argparse.Namespace, command: str, keys: tuple[str, ...] = ("method", "budget", "layer", "options")
) -> dict[str, Any]:
    """The ``--config`` file's ``keys`` (defaults filled in), for commands that pass only those to
    ``priortr.apply``; a file that sets any other keyword is refused rather than half-applied. The
    values themselves are checked by ``priortr.apply`` when the command prunes."""
    from priortr.api import apply_defaults
    from priortr.config_file import read_config

    defaults = apply_defaults()
    stored = read_config(args.config, defaults)
    extra = sorted(name for name, value in stored.items() if name not in keys and value != defaults[name])
    if extra:
        raise ValueError(
            f"priortr {command} takes only {', '.join(keys)} from a config, and {args.config!r} also sets "
            f"{', '.join(extra)}: use `priortr generate` or priortr.apply(model, config=...) for it"
        )
    return {name: stored.get(name, defaults[name]) for name in keys}
