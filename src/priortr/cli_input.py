"""Command-line input, checked before any work: argument types, models, devices and output paths.

Every command of ``priortr.cli`` runs ``check(args)`` before it loads a model or measures anything, so
that a typo in the last ``--methods`` entry or an unwritable ``--out`` costs a second, not the run.
Pruning arguments are checked by ``priortr.apply`` itself, on a skeleton of the model built on the
``meta`` device from its config (no weights, no memory), so the command line accepts exactly what the
Python API accepts. A bad value raises ``ValueError`` with one line naming the value and what is
allowed; ``priortr.cli.main`` prints it and exits 2.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

TESTBED = "testbed"  # --model name of the trained testbed (priortr.testbed), assembled on first use
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
ATTENTION = ("sdpa", "eager", "flash_attention_2")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
FILE_SUFFIXES = (".json", ".png", ".jpg", ".jpeg", ".safetensors", ".bin", ".gguf", ".pt", ".txt")


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


def distinct(option: str, values: Sequence[Any] | None) -> None:
    """Refuse a value given twice in a list option (it would be measured twice under one label)."""
    repeated = sorted({str(v) for v in values or [] if list(values).count(v) > 1})
    if repeated:
        raise ValueError(f"{option} lists {', '.join(repeated)} more than once; give each value once")


# -- devices ------------------------------------------------------------------------------------------


def check_device(text: str) -> torch.device:
    """A device this machine has: ``cpu``, ``cuda``/``cuda:N`` with CUDA present, ``mps`` on Apple."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device {text!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"--device {text}: this machine has no CUDA device (torch {torch.__version__}); "
                "use --device cpu"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device {text}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
            )
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {text}: MPS is not available on this machine; use --device cpu")
    elif device.type != "cpu":
        raise ValueError(f"--device {text}: priortr runs on cpu, cuda or mps")
    return device


# -- models -------------------------------------------------------------------------------------------


def model_source(name: str) -> str:
    """``--model`` of a command that loads real weights: the checkpoint directory, or a hub id.

    Local-looking names (an absolute or relative path, a file name) are never sent to the hub: a
    missing one is refused at once instead of after the hub client's retries.
    """
    from priortr.configs import SOURCES

    if name == TESTBED:
        from priortr.testbed.assemble import checkpoint

        return str(checkpoint())
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--model {name}: directory has no config.json; pass a transformers checkpoint directory"
            )
        return str(path)
    if path.exists():
        raise ValueError(f"--model {name} is a file; pass the checkpoint directory that holds config.json")
    if name in SOURCES:
        raise ValueError(
            f"--model {name} is a shipped config of `priortr bench`/`flops` (shapes only, random weights); "
            f"this command needs real weights: {TESTBED}, a checkpoint directory or a hub id owner/name"
        )
    local = name.startswith((".", "/", "~")) or name.lower().endswith(FILE_SUFFIXES) or "\\" in name
    if local or not HUB_ID.fullmatch(name):
        raise ValueError(
            f"--model {name}: no such directory; pass {TESTBED}, a checkpoint directory "
            "or a hub id owner/name"
        )
    return name


def model_config(source: str) -> Any:
    """The transformers config of a checkpoint directory (read locally) or hub id (fetched)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, local_files_only=Path(source).is_dir())
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--model {source}: cannot read its config: {_first_line(exc)}") from exc


def check_family(config: Any, option: str = "--model") -> None:
    """Refuse a model type that no adapter handles, naming the supported families."""
    from priortr.adapters import _ADAPTERS, supported_model_types

    model_type = getattr(config, "model_type", None)
    if model_type not in _ADAPTERS:
        families = sorted({adapter.name for adapter in _ADAPTERS.values()})
        raise ValueError(
            f"{option}: model type {model_type!r} is not a vision-language family priortr supports "
            f"({', '.join(families)}; model types {', '.join(supported_model_types())})"
        )


def skeleton(config: Any) -> nn.Module:
    """The multimodal model of ``config`` on the meta device: every module, no weights."""
    from transformers import AutoModelForImageTextToText

    check_family(config)
    try:
        with torch.device("meta"):
            return AutoModelForImageTextToText.from_config(config)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"--model: transformers cannot build this model: {_first_line(exc)}") from exc


def check_pruning(model: nn.Module, **apply_arguments: Any) -> None:
    """What ``priortr.apply`` says of these arguments on ``model`` (a skeleton), attaching nothing."""
    import priortr

    priortr.apply(model, **apply_arguments).remove()


# -- output paths -------------------------------------------------------------------------------------


def output_file(
    text: str, option: str = "--out", suffixes: Iterable[str] = (".png", ".pdf", ".svg", ".jpg")
) -> Path:
    """The file an ``--out`` file option writes: ``.png`` appended to a name without a suffix, an
    existing directory or an unknown suffix refused, and its folder checked writable now."""
    path = Path(text).expanduser()
    suffixes = tuple(suffixes)
    if path.is_dir():
        raise ValueError(f"{option} {text} is a directory; give a file path such as {path / 'maps.png'}")
    if not path.suffix:
        path = path.with_name(path.name + suffixes[0])
    elif path.suffix.lower() not in suffixes:
        raise ValueError(
            f"{option} {text}: unknown image suffix {path.suffix}; use one of {', '.join(suffixes)}"
        )
    writable_directory(path.parent, option, text)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{option} {text}: the file exists and is not writable")
    return path


def output_directory(text: str, option: str = "--out") -> Path:
    """An ``--out`` folder, created now and checked writable."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {text} is a file; give a folder")
    writable_directory(path, option, text)
    return path


def writable_directory(path: Path, option: str, text: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {text}: cannot write to {path}: {exc.strerror or exc}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- each command's checks ----------------------------------------------------------------------------


def read_image(text: str) -> Any:
    """The ``--image`` file as RGB, read now so that a bad path fails before the model loads."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(text) as image:
            return image.convert("RGB")
    except UnidentifiedImageError:
        raise ValueError(f"cannot read image {text!r}: not an image file PIL can open") from None
    except OSError as exc:
        raise ValueError(f"cannot read image {text!r}: {exc.strerror or exc}") from None


def _stages_conflict(args: argparse.Namespace) -> None:
    if args.stages and (args.budget is not None or args.layer is not None):
        given = " and ".join(
            o for o, v in (("--budget", args.budget), ("--layer", args.layer)) if v is not None
        )
        raise ValueError(f"--stages sets each stage's layer and budget; drop {given} or drop --stages")


def _one_image_model(args: argparse.Namespace) -> nn.Module:
    """Checks shared by generate and viz; returns the model's skeleton, sets ``args.source`` (the
    checkpoint directory or hub id) and ``args.loaded_image``."""
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; ask a question about the image")
    args.device = str(check_device(args.device))
    args.loaded_image = read_image(args.image)
    args.source = model_source(args.model)
    return skeleton(model_config(args.source))


def check_generate(args: argparse.Namespace) -> None:
    _stages_conflict(args)
    model = _one_image_model(args)
    config = {"config": args.config} if args.config else {}
    check_pruning(
        model,
        method=args.method,
        budget=args.budget,
        layer=args.layer,
        stages=args.stages,
        options=dict(args.option or []),
        **config,
    )


def check_viz(args: argparse.Namespace) -> None:
    import priortr

    distinct("--layers", args.layers)
    distinct("--budgets", args.budgets)
    args.out = output_file(args.out)
    info = priortr.get_method(args.method)
    if info.where != "layer" or "attention" not in info.needs:
        drawable = [
            name
            for name in priortr.available_methods()
            if priortr.get_method(name).where == "layer" and "attention" in priortr.get_method(name).needs
        ]
        raise ValueError(
            f"--method {args.method} does not score prior and posterior attention after one decoder layer, "
            f"so there are no maps to draw; use one of {', '.join(drawable)}"
        )
    model = _one_image_model(args)
    for layer in args.layers:
        for budget in args.budgets:
            check_pruning(model, method=args.method, budget=budget, layer=layer)


def check_eval(args: argparse.Namespace) -> None:
    from priortr.testbed.evaluate import VANILLA, layer_for

    distinct("--methods", args.methods)
    distinct("--budgets", args.budgets)
    args.device = str(check_device(args.device))
    args.out = output_directory(args.out)
    args.source = model_source(args.model)
    model = skeleton(model_config(args.source))
    for method in args.methods:
        for budget in [] if method == VANILLA else args.budgets:
            check_pruning(
                model, method=method, budget=budget, layer=layer_for(method, args.layer), strict=True
            )


def check_bench(args: argparse.Namespace) -> None:
    import priortr
    from priortr import bench

    distinct("--methods", args.methods)
    distinct("--budgets", args.budgets)
    distinct("--batch-sizes", args.batch_sizes)
    device = check_device(args.device)
    args.device = str(device)
    if args.attn == "flash_attention_2" and device.type != "cuda":
        raise ValueError("--attn flash_attention_2 runs on CUDA only; use sdpa or eager")
    args.out = output_directory(args.out)
    model = skeleton(bench.bench_config(args.model, args.layers, args.vision_layers))
    methods = args.methods or [bench.VANILLA, *priortr.available_methods()]
    for method in methods:
        if method == bench.VANILLA:
            continue
        layer = args.layer if priortr.get_method(method).where == "layer" else None
        for budget in args.budgets:
            check_pruning(model, method=method, budget=budget, layer=layer, options=dict(args.option or []))


def check_demo(args: argparse.Namespace) -> None:
    from priortr.testbed import demo
    from priortr.testbed.assemble import checkpoint

    if args.save_image is not None:  # only the scene image: no model
        args.save_image = output_file(args.save_image, "--save-image", (".png", ".jpg"))
        return
    args.out = output_file(args.out)
    chosen = demo.setting(args.config, args.layer, args.budget)
    model = skeleton(model_config(str(checkpoint())))
    for method in demo.METHODS:
        check_pruning(model, method=method, budget=chosen["budget"], layer=chosen["layer"])


def check_calibrate(args: argparse.Namespace) -> None:
    from priortr import calibrate

    distinct("--methods", args.methods)
    distinct("--layers", args.layers)
    distinct("--budgets", args.budgets)
    if not 0.0 < args.target <= 1.0:
        raise ValueError(f"--target {args.target}: an agreement share in (0, 1], e.g. 0.95")
    args.settings = calibrate.grid(args.methods, args.layers, args.budgets)
    args.device = str(check_device(args.device))
    args.out = output_directory(args.out)
    args.prompts = calibrate.load_prompts(args.data, args.limit)
    args.source = model_source(args.model)


def check_report(args: argparse.Namespace) -> None:
    if args.out is not None:
        args.out = output_directory(args.out)


def check_flops(args: argparse.Namespace) -> None:
    distinct("--budgets", args.budgets)
    distinct("--methods", args.methods)


CHECKS: dict[str, Callable[[argparse.Namespace], None]] = {
    "generate": check_generate,
    "viz": check_viz,
    "eval": check_eval,
    "bench": check_bench,
    "demo": check_demo,
    "calibrate": check_calibrate,
    "report": check_report,
    "flops": check_flops,
}


def check(args: argparse.Namespace) -> None:
    """Every check of ``args.command`` (nothing for commands that only print)."""
    CHECKS.get(args.command, lambda _: None)(args)


def one_line(exc: BaseException) -> str:
    """An error as one line (a message of several lines keeps its first, and says that it was cut)."""
    text = " ".join(str(exc).split()) if "\n" not in str(exc).strip() else _first_line(exc) + " (...)"
    return text or type(exc).__name__
