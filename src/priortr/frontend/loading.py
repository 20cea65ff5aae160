"""Loading a model to prune: processor + model + dtype + device + attention implementation, in one place.

The command line, the lmms-eval plug-in and the testbed demo all load through :func:`load`, so a user
meets the same checks and the same one-line errors everywhere: a missing directory, a file instead of a
checkpoint, a text-only model or a family priortr has no adapter for, a device this machine lacks and a
dtype that device cannot run. The checks read only the checkpoint's config, so they answer before any
weights are read; the CLI runs them up front (``priortr.cli.checks``).

torch and transformers are imported inside the functions: the CLI builds its parser from ``DTYPES`` and
``ATTENTION`` and must answer ``--help`` without importing them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

DTYPES = ("float32", "float16", "bfloat16", "float64")  # names of torch dtypes a model may load in
ATTENTION = ("sdpa", "eager", "flash_attention_2")  # transformers' attn_implementation values
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
FILE_SUFFIXES = (".json", ".png", ".jpg", ".jpeg", ".safetensors", ".bin", ".gguf", ".pt", ".txt")


def torch_dtype(name: str | None) -> torch.dtype | str:
    """The torch dtype named ``name`` (one of ``DTYPES``); ``None`` or ``auto``: the checkpoint's."""
    import torch

    if name in (None, "auto"):
        return "auto"
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: use auto or one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def check_device(text: str, option: str = "--device") -> torch.device:
    """A device this machine has: ``cpu``, ``cuda``/``cuda:N`` with CUDA present, ``mps`` on Apple."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"{option} {text!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"{option} {text}: this machine has no CUDA device (torch {torch.__version__}); "
                f"use {option} cpu"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"{option} {text}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
            )
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"{option} {text}: MPS is not available on this machine; use {option} cpu")
    elif device.type != "cpu":
        raise ValueError(f"{option} {text}: priortr runs on cpu, cuda or mps")
    return device


def check_dtype(name: str | None, device: torch.device) -> None:
    """Refuse a dtype that ``device`` cannot compute in (found now, not at the first matmul)."""
    import torch

    torch_dtype(name)  # a known name
    if device.type == "mps" and name == "float64":
        raise ValueError("dtype float64 does not run on MPS; use float32 or float16")
    if device.type == "cuda" and name == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"dtype bfloat16 is not supported by {torch.cuda.get_device_name(device)}; use float16"
        )


def model_source(name: str, option: str = "--model", named: Sequence[str] = ()) -> str:
    """A checkpoint to load real weights from: the checkpoint directory, or a hub id.

    Local-looking names (an absolute or relative path, a file name) are never sent to the hub: a
    missing one is refused at once instead of after the hub client's retries. ``named``: the model
    names the caller resolves itself (the CLI's ``testbed``), offered in the messages.
    """
    from priortr.frontend.configs import SOURCES

    choices = ", ".join([*named, "a checkpoint directory"]) + " or a hub id owner/name"
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{option} {name}: directory has no config.json; pass a transformers checkpoint directory"
            )
        return str(path)
    if path.exists():
        raise ValueError(f"{option} {name} is a file; pass the checkpoint directory that holds config.json")
    if name in SOURCES:
        raise ValueError(
            f"{option} {name} is a shipped config of `priortr bench`/`flops` (shapes only, random weights); "
            f"this command needs real weights: {choices}"
        )
    local = name.startswith((".", "/", "~")) or name.lower().endswith(FILE_SUFFIXES) or "\\" in name
    if local or not HUB_ID.fullmatch(name):
        raise ValueError(f"{option} {name}: no such directory; pass {choices}")
    return name


def model_config(source: str, option: str = "--model") -> Any:
    """The transformers config of a checkpoint directory (read locally) or hub id (fetched)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, local_files_only=Path(source).is_dir())
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{option} {source}: cannot read its config: {first_line(exc)}") from exc


def check_family(config: Any, option: str = "--model") -> None:
    """Refuse a model type that no adapter handles (a text-only model among them), naming the supported
    families."""
    from priortr.adapters import supported_families, supported_model_types

    model_type = getattr(config, "model_type", None)
    if model_type not in supported_model_types():
        families = supported_families()
        text_only = "" if hasattr(config, "vision_config") else "; it has no vision tower (a text-only model)"
        raise ValueError(
            f"{option}: model type {model_type!r} is not a vision-language family priortr supports "
            f"({', '.join(families)}; model types {', '.join(supported_model_types())}){text_only}"
        )


def load(
    source: str,
    dtype: str | None = None,
    device: str = "cpu",
    *,
    attn_implementation: str | None = None,
    device_map: str | None = None,
    option: str = "--model",
    processor: Any = None,
) -> tuple[Any, nn.Module]:
    """(processor, model in eval mode) from a hub id or checkpoint directory, checked first.

    ``dtype``: a name of ``DTYPES``, or None/``auto`` for the checkpoint's. ``device_map`` (model
    parallel, or straight onto one device without a host copy) is passed to ``from_pretrained``;
    without it the model is loaded and then moved to ``device``. ``processor``: one loaded already
    (:func:`load_processor`, to check prompts before the weights load). Any failure is a ValueError
    naming ``option`` (how the caller's user named the model).
    """
    from transformers import AutoModelForImageTextToText

    check_dtype(dtype, check_device(device, "device"))
    source = model_source(source, option)
    check_family(model_config(source, option), option)
    extra: dict[str, Any] = {"device_map": device_map} if device_map else {}
    if attn_implementation:
        extra["attn_implementation"] = attn_implementation
    processor = load_processor(source) if processor is None else processor
    try:
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch_dtype(dtype), **extra)
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        raise ValueError(f"cannot load model {source!r}: {exc}") from exc
    if device_map:
        return processor, model.eval()
    try:
        return processor, model.to(device).eval()
    except (RuntimeError, AssertionError) as exc:  # torch raises AssertionError for CUDA-less builds
        raise ValueError(f"cannot move the model to device {device!r}: {exc}") from exc


def load_processor(source: str) -> Any:
    """The processor of a checkpoint directory or hub id (tokenizer and image processor, no weights)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(source)
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        raise ValueError(f"cannot load model {source!r}: {exc}") from exc


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
