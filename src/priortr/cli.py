"""``priortr`` command line: a thin layer over ``priortr.apply`` for trying pruning on one image.

    priortr generate --model llava-hf/llava-1.5-7b-hf --image cat.png --prompt "What is this?" --budget 64

All pruning logic lives in the Python API; this module only parses arguments, loads a model with
transformers, and reports what the API returns.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
import time
from typing import Any

import torch
from torch import nn

import priortr

log = logging.getLogger("priortr.cli")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_budget(text: str) -> int | float:
    """An integer literal is a token count, anything else a ratio; the API checks the range."""
    try:
        return int(text) if re.fullmatch(r"[+-]?\d+", text.strip()) else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


class PrefillTimer:
    """Wall time of the first forward call of ``model``, i.e. the prefill inside ``generate``.

    Hooks on the top-level model see the whole prefill (vision tower, pruned decoder and LM head);
    on CUDA the clock is read after a synchronise so that queued kernels are counted.
    """

    def __init__(self, model: nn.Module) -> None:
        self.ms: float | None = None
        self._start: float | None = None
        self._sync = (lambda: torch.cuda.synchronize()) if model.device.type == "cuda" else (lambda: None)
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        if self._start is None:
            self._sync()
            self._start = time.perf_counter()

    def _post(self, *_: Any) -> None:
        if self.ms is None:
            self._sync()
            self.ms = (time.perf_counter() - self._start) * 1e3

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def load(model_id: str, dtype: str | None, device: str) -> tuple[Any, nn.Module]:
    """Processor and model from a hub id or a local directory; any loading failure becomes a ValueError."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(model_id)
        model = AutoModelForImageTextToText.from_pretrained(model_id, dtype=DTYPES.get(dtype, "auto"))
    except (OSError, ValueError, RuntimeError) as exc:
        raise ValueError(f"cannot load model {model_id!r}: {exc}") from exc
    try:
        return processor, model.to(device).eval()
    except (RuntimeError, AssertionError) as exc:  # torch raises AssertionError for CUDA-less builds
        raise ValueError(f"cannot move the model to device {device!r}: {exc}") from exc


def cmd_generate(args: argparse.Namespace) -> int:
    """Answer ``--prompt`` about ``--image`` with greedy decoding, pruned unless ``--no-prune``."""
    from PIL import Image

    try:  # before the (slow) model load, to fail fast on a bad path
        image = Image.open(args.image).convert("RGB")
    except OSError as exc:
        raise ValueError(f"cannot read image {args.image!r}: {exc.strerror or exc}") from exc
    log.info("loading %s (dtype %s) onto %s", args.model, args.dtype or "auto", args.device)
    processor, model = load(args.model, args.dtype, args.device)
    content = [{"type": "image", "image": image}, {"type": "text", "text": args.prompt}]
    messages = [{"role": "user", "content": content}]
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    ).to(model.device, dtype=model.dtype)  # only floating tensors (pixels) are cast
    pruning = (
        contextlib.nullcontext()
        if args.no_prune
        else priortr.apply(model, method=args.method, budget=args.budget, layer=args.layer)
    )
    with pruning as handle, torch.inference_mode():
        timer = PrefillTimer(model)
        try:
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        finally:
            timer.remove()
        last = handle.last if handle is not None else None
    n_prompt = inputs["input_ids"].shape[1]
    print(processor.decode(out[0, n_prompt:], skip_special_tokens=True).strip())
    if handle is None:
        print("visual tokens kept: all (pruning off, --no-prune)")
    elif last is None:
        print("visual tokens kept: all (the prompt had nothing to prune)")
    else:
        print(f"visual tokens kept: {last.kept.shape[-1]} / {last.scores.shape[-1]}")
    print(f"prefill: {timer.ms:.1f} ms")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one sub-parser per command, each dispatching to its ``cmd_*`` function."""
    parser = argparse.ArgumentParser(prog="priortr", description="Prior-corrected visual token pruning.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log diagnostics to stderr")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = commands.add_parser(
        "generate", help="answer a prompt about an image", description=cmd_generate.__doc__
    )
    gen.add_argument("--model", required=True, help="hub id or local checkpoint directory")
    gen.add_argument("--image", required=True, help="path of the image file")
    gen.add_argument("--prompt", required=True, help="the question or instruction")
    methods = ", ".join(priortr.available_methods())
    gen.add_argument("--method", default="priortr", help=f"scoring rule: {methods}")
    gen.add_argument("--budget", type=parse_budget, default=64, help="kept tokens: count, or ratio in (0, 1)")
    gen.add_argument("--layer", type=int, default=2, help="0-indexed decoder layer whose attention is scored")
    gen.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    gen.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--no-prune", action="store_true", help="run the stock model, for comparison")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; return 0, or 2 after printing ``priortr: error: ...`` for bad input."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage error (already printed)
        return exc.code if isinstance(exc.code, int) else 0
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    log.setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    log.info("arguments: %s", {k: v for k, v in vars(args).items() if k != "func"})
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        log.debug("traceback", exc_info=True)
        print(f"priortr: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
