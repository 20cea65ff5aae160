"""Checks that several commands run on their input before any work: devices, models, the testbed, output
paths and pruning arguments.

Every command runs its ``check(args)`` before it loads a model or measures anything, so that a typo in
the last ``--methods`` entry or an unwritable ``--out`` costs a second, not the run. Pruning arguments
are checked by ``priortr.apply`` itself, on a skeleton of the model built on the ``meta`` device from
its config (no weights, no memory), so the command line accepts exactly what the Python API accepts. A
bad value raises ``ValueError`` with one line naming the value and what is allowed; ``priortr.cli.main``
prints it and exits 2. Model and device checks are ``priortr.frontend.loading``'s, the ones every front
end uses.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from priortr.cli.arguments import TESTBED
from priortr.frontend import loading

if TYPE_CHECKING:
    from torch import nn


def distinct(option: str, values: Sequence[Any] | None) -> None:
    """Refuse a value given twice in a list option (it would be measured twice under one label)."""
    repeated = sorted({str(v) for v in values or [] if list(values).count(v) > 1})
    if repeated:
        raise ValueError(f"{option} lists {', '.join(repeated)} more than once; give each value once")


def device(args: argparse.Namespace) -> Any:
    """``--device`` checked (default: ``cuda`` when available, else ``cpu``) and ``--dtype`` checked
    against it; ``args.device`` becomes the device's name. Returns the ``torch.device``."""
    import torch

    checked = loading.check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    loading.check_dtype(args.dtype, checked)
    args.device = str(checked)
    return checked


# -- models -------------------------------------------------------------------------------------------


def testbed() -> None:
    """Refuse a testbed command, before anything loads, when the testbed's extra is not installed."""
    from priortr.testbed import require

    try:
        require()
    except ImportError as exc:
        raise ValueError(str(exc)) from None


def model_source(name: str) -> str:
    """``--model`` of a command that loads real weights: the testbed's checkpoint directory (assembled on
    first use), another checkpoint directory, or a hub id (``loading.model_source``)."""
    if name == TESTBED:
        testbed()
        from priortr.testbed.assemble import checkpoint

        return str(checkpoint())
    return loading.model_source(name, "--model", (TESTBED,))


def skeleton(config: Any) -> nn.Module:
    """The multimodal model of ``config`` on the meta device: every module, no weights."""
    import torch
    from transformers import AutoModelForImageTextToText

    loading.check_family(config)
    try:
        with torch.device("meta"):
            return AutoModelForImageTextToText.from_config(config)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"--model: transformers cannot build this model: {loading.first_line(exc)}") from exc


def check_pruning(model: nn.Module, **apply_arguments: Any) -> None:
    """What ``priortr.apply`` says of these arguments on ``model`` (a skeleton), attaching nothing."""
    import priortr

    priortr.apply(model, **apply_arguments).remove()


def read_image(text: str) -> Any:
    """The ``--image`` file as RGB, read now so that a bad path fails before the model loads."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(text) as image:
            return image.convert("RGB")
    except UnidentifiedImageError:
        raise ValueError(f"cannot read image {text!r}: not an image file PIL can open") from None
    except Image.DecompressionBombError as exc:
        raise ValueError(f"cannot read image {text!r}: {exc} (PIL's limit); resize it") from None
    except OSError as exc:
        raise ValueError(f"cannot read image {text!r}: {exc.strerror or exc}") from None


def one_image_model(args: argparse.Namespace) -> nn.Module:
    """Checks shared by generate and viz; returns the model's skeleton, sets ``args.source`` (the
    checkpoint directory or hub id), ``args.loaded_image`` and ``args.processor`` (loaded to check the
    prompt against its image placeholder before the weights load)."""
    from priortr.frontend.prompts import check_prompt

    if not args.prompt.strip():
        raise ValueError("--prompt is empty; ask a question about the image")
    device(args)
    args.loaded_image = read_image(args.image)
    args.source = model_source(args.model)
    model = skeleton(loading.model_config(args.source))
    args.processor = loading.load_processor(args.source)
    try:
        check_prompt(args.processor, args.prompt)
    except ValueError as exc:
        raise ValueError(f"--prompt: {exc}") from None
    return model


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
    """Create ``path`` and write a temporary file in it, or refuse ``option``'s value ``text``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {text}: cannot write to {path}: {exc.strerror or exc}") from None


def one_line(exc: BaseException) -> str:
    """An error as one line (a message of several lines keeps its first, and says that it was cut)."""
    text = " ".join(str(exc).split()) if "\n" not in str(exc).strip() else loading.first_line(exc) + " (...)"
    return text or type(exc).__name__
