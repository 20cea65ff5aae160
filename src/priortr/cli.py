"""``priortr`` command line: a thin layer over ``priortr.apply`` for trying pruning on one image.

    priortr generate --model llava-hf/llava-1.5-7b-hf --image cat.png --prompt "What is this?" --budget 64

All pruning logic lives in the Python API; this module only parses arguments, loads a model with
transformers, and reports what the API returns.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import priortr
from priortr import cli_input, viz
from priortr.cli_input import DTYPES, TESTBED, nonnegative_int, positive_int

log = logging.getLogger("priortr.cli")


def parse_budget(text: str) -> int | float:
    """An integer literal is a token count, anything else a ratio; the API checks the range."""
    try:
        return int(text) if re.fullmatch(r"[+-]?\d+", text.strip()) else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def parse_option(text: str) -> tuple[str, Any]:
    """``name=value`` with a Python literal value (``neighbours=8``, ``adaptive=True``), or a plain string."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"an option is name=value, got {text!r}")
    try:
        return name.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return name.strip(), value.strip()


def parse_stage(text: str) -> tuple[int, int | float]:
    """``layer:budget``, e.g. ``7:288``."""
    layer, sep, budget = text.partition(":")
    if not sep or not re.fullmatch(r"[+-]?\d+", layer.strip()):
        raise argparse.ArgumentTypeError(f"a stage is layer:budget (e.g. 7:288), got {text!r}")
    if int(layer) < 0:
        raise argparse.ArgumentTypeError(f"a stage's layer is a decoder layer index >= 0, got {text!r}")
    return int(layer), parse_budget(budget)


def pruning_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The ``priortr.apply`` keywords shared by the commands that prune; with ``--config``, the file's
    (``priortr.apply`` refuses a flag that the file sets differently)."""
    arguments = {
        "method": args.method,
        "budget": args.budget,
        "layer": args.layer,
        "stages": args.stages,
        "options": dict(args.option or []),
    }
    return {**arguments, "config": args.config} if args.config else arguments


def config_setting(
    args: argparse.Namespace, command: str, keys: tuple[str, ...] = ("method", "budget", "layer", "options")
) -> dict[str, Any]:
    """The ``--config`` file's ``keys`` (defaults filled in), for commands that pass only those to
    ``priortr.apply``; a file that sets any other keyword is refused rather than half-applied. The
    values themselves are checked by ``priortr.apply`` when the command prunes."""
    from priortr.config_file import apply_defaults, read_config

    stored = read_config(args.config)
    defaults = apply_defaults()
    extra = sorted(name for name, value in stored.items() if name not in keys and value != defaults[name])
    if extra:
        raise ValueError(
            f"priortr {command} takes only {', '.join(keys)} from a config, and {args.config!r} also sets "
            f"{', '.join(extra)}: use `priortr generate` or priortr.apply(model, config=...) for it"
        )
    return {name: stored.get(name, defaults[name]) for name in keys}


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
    """Processor and model from a hub id or a local directory (``cli_input.model_source``); any loading
    failure becomes a ValueError."""
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
    log.info("loading %s (dtype %s) onto %s", args.model, args.dtype or "auto", args.device)
    processor, model = load(args.source, args.dtype, args.device)
    inputs = viz.chat_inputs(processor, args.loaded_image, args.prompt, model)
    pruning = contextlib.nullcontext() if args.no_prune else priortr.apply(model, **pruning_arguments(args))
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
        print(f"visual tokens kept: {int((last.kept[0] >= 0).sum())} / {int(last.n_visual[0])}")
    print(f"prefill: {timer.ms:.1f} ms")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    """List every method: the name ``--method`` takes, where it prunes, its knobs and its source paper."""
    where = {
        "vision": "before the LLM",
        "layer": "after decoder layer L",
        "layers": "after several decoder layers",
    }
    rows = []
    for name in priortr.available_methods():
        info = priortr.get_method(name)
        knobs = ", ".join(f"{knob}={default!r}" for knob, default in info.knobs.items())
        rows.append({"name": name, "where": where[info.where], "knobs": knobs, "source": info.source})
    if args.json:
        print(json.dumps(rows))
        return 0
    widths = {key: max(len(key), *(len(row[key]) for row in rows)) for key in ("name", "where")}
    for row in rows:
        print(f"{row['name']:<{widths['name']}}  {row['where']:<{widths['where']}}  {row['source']}")
        if row["knobs"]:
            print(f"{'':<{widths['name']}}  options: {row['knobs']}")
    return 0


def cmd_flops(args: argparse.Namespace) -> int:
    """Analytic FLOPs (the paper's protocol, Appendix "Efficiency Analysis") of vanilla and each method."""
    from priortr import flops

    if args.config:
        setting = config_setting(args, "flops", ("method", "budget", "layer"))
        args.methods, args.budgets = [setting["method"]], [setting["budget"]]
        args.layer = args.layer if setting["layer"] is None else setting["layer"]
    report = flops.flops_report(
        args.model,
        args.budgets,
        methods=args.methods,
        layer=args.layer,
        text_tokens=args.text_tokens,
        decode_steps=args.decode_steps,
        image_tokens=args.image_tokens,
        exact=args.exact,
    )
    print(json.dumps(report) if args.json else flops.format_table(report))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Measure prefill, KV cache and throughput for vanilla and each method x budget x batch size;
    every measurement is recorded as it finishes (``bench.jsonl``, read back by ``--resume``)."""
    from tqdm import tqdm

    from priortr import bench
    from priortr.journal import Journal

    if args.config:
        setting = config_setting(args, "bench")
        args.methods, args.budgets = [bench.VANILLA, setting["method"]], [setting["budget"]]
        args.layer, args.option = setting["layer"], list(setting["options"].items())
    out = Path(args.out)
    settings = {
        key: getattr(args, key)
        for key in ("model", "layers", "vision_layers", "layer", "option", "text_tokens", "new_tokens")
    }
    settings.update(device=args.device, dtype=args.dtype, attn=args.attn)
    settings["option"] = [list(option) for option in args.option or []]
    journal = Journal(out / "bench.jsonl", settings, args.resume)
    model = bench.build_model(
        args.model, torch.device(args.device), DTYPES[args.dtype], args.layers, args.vision_layers, args.attn
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
    journal.close()
    report = runner.report()
    report.meta["peak_rss_bytes"] = bench.peak_rss_bytes()
    document = report.to_json()
    (out / "bench.json").write_text(json.dumps(document, indent=2))
    (out / "bench.md").write_text(bench.format_markdown(report))
    bench.plot(report, out / "bench.png")
    print(json.dumps(document) if args.json else bench.format_markdown(report))
    return 0


def cmd_viz(args: argparse.Namespace) -> int:
    """Draw the prior Q, posterior P, score S and kept tokens over the image, one row per layer x budget
    (the paper's qualitative figure)."""
    from priortr.adapters import adapter_for

    image = args.loaded_image
    log.info("loading %s (dtype %s) onto %s", args.model, args.dtype or "auto", args.device)
    if args.config:
        setting = config_setting(args, "viz", ("method", "budget", "layer"))
        args.method, args.budgets = setting["method"], [setting["budget"]]
        args.layers = args.layers if setting["layer"] is None else [setting["layer"]]
    processor, model = load(args.source, args.dtype, args.device)
    results = viz.attention_maps(
        model, processor, image, args.prompt, layers=args.layers, budgets=args.budgets, method=args.method
    )
    view = adapter_for(model).image_view(image, processor)
    title = f'{Path(args.model).name or args.model}, {args.method}: "{args.prompt}"'
    print(viz.render(results, view, args.out, title=title))
    for maps in results:
        print(
            f"layer {maps.layer}, budget {maps.budget}: visual tokens kept: {maps.n_kept} / {maps.n_visual}"
        )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The trained testbed on a fixed set of held-out scenes at the setting its calibration chose: per
    method (full model, FastV, PriorTR) the answers right, the agreement with the full model and the
    measured LM prefill time; then a PNG of prior, posterior, score and kept tokens for one question."""
    from priortr.testbed import demo

    sample = demo.demo_sample()
    image = sample.image()
    if args.save_image is not None:
        image.save(args.save_image)
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
    base = rows[0].lm_prefill_ms
    print(f"  {'method':<8} {'right':>7} {'agrees':>7} {'LM prefill':>11} {'speed-up':>9}")
    for row in rows:
        print(
            f"  {row.method:<8} {row.correct:>3}/{row.total:<3} {row.agreement:>7.0%} "
            f"{row.lm_prefill_ms:>8.1f} ms {base / row.lm_prefill_ms:>8.2f}x"
        )
    sample = demo.demo_sample()
    print(f"maps for scene {sample.image_id}: {sample.question} (reference answer: {sample.answer})")
    print(demo.figure(model, processor, sample, sample.image(), budget, layer, Path(args.out)))
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Accuracy on a named split for methods x budgets; writes every answer as it comes
    (``<split>.samples.jsonl``, read back by ``--resume``), then JSON, a markdown table and a retention
    plot."""
    from priortr.journal import Journal
    from priortr.testbed import data, evaluate

    if args.config:
        setting = config_setting(args, "eval", ("method", "budget", "layer"))
        args.methods, args.budgets = [evaluate.VANILLA, setting["method"]], [setting["budget"]]
        args.layer = args.layer if setting["layer"] is None else setting["layer"]
    samples = data.load_split(args.split, args.limit)
    settings = {"split": args.split, "limit": args.limit, "model": args.model, "layer": args.layer}
    settings["dtype"] = args.dtype
    journal = Journal(Path(args.out) / f"{args.split}.samples.jsonl", settings, args.resume)
    processor, model = load(args.source, args.dtype, args.device)
    evaluation = evaluate.Evaluation(
        model, processor, samples, args.split, args.methods, args.budgets, args.layer, args.model, journal
    )
    with finished_so_far(lambda: evaluation.report().to_markdown(), journal.path):
        evaluation.run(args.batch_size)
    journal.close()
    report = evaluation.report()
    for path in report.write(args.out, args.split):
        log.info("wrote %s", path)
    print(report.to_markdown())
    print(f"wrote {args.out}/{args.split}.{{samples.jsonl,json,md,png}}")
    return 0


@contextlib.contextmanager
def finished_so_far(table: Callable[[], str], journal: Path) -> Iterator[None]:
    """On Ctrl-C or a failure inside the block, print the table of what finished and how to resume."""
    try:
        yield
    except BaseException:
        print(table(), end="")
        print(f"stopped early; what finished is recorded in {journal}: rerun with --resume to continue")
        raise


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Without labels, how faithful each method x layer x budget stays to the unpruned model on your
    prompts (answer agreement, first-token KL) and what it saves (measured LM prefill speed-up, FLOPs);
    recommends per method the fastest configuration reaching --target and writes it as a config file."""
    from priortr import calibrate

    processor, model = load(args.source, args.dtype, args.device)
    result = calibrate.calibrate(
        model,
        processor,
        args.prompts,  # prompts and grid: from cli_input.check_calibrate, before the model load
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
    paths = result.write(args.out)
    print(result.to_markdown(), end="")
    for path in paths:
        print(f"wrote {path}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """The paper's table from lmms-eval result folders: a row per (model, budget, method), a column per
    benchmark in its own metric, and Avg %: the mean of score / baseline (unpruned) score, x 100."""
    from priortr import report

    table = report.build_table(report.load_runs(args.results), baseline=args.baseline)
    print(report.to_markdown(table), end="")
    for path in report.write(table, args.out) if args.out else []:
        print(f"wrote {path}")
    return 0


LAYER_HELP = "0-indexed decoder layer scored by one-layer methods (default 2)"
CONFIG_HELP = "a config file of priortr.apply keywords, e.g. recommended.json of `priortr calibrate`"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--image``, ``--prompt``, ``--device``, ``--dtype``: one real prompt on a checkpoint."""
    parser.add_argument(
        "--model",
        required=True,
        help=f"hub id, local checkpoint directory, or {TESTBED} (the trained testbed)",
    )
    parser.add_argument("--image", required=True, help="path of the image file")
    parser.add_argument("--prompt", required=True, help="the question or instruction")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: the checkpoint's")


def add_layer_arguments(parser: argparse.ArgumentParser) -> None:
    """``--layer``, ``--stages`` and ``--option``: where and how a method prunes."""
    parser.add_argument("--layer", type=nonnegative_int, help=LAYER_HELP)
    parser.add_argument(
        "--stages",
        type=parse_stage,
        nargs="+",
        help="explicit stages layer:budget (e.g. 7:288 15:144), instead of --budget and --layer",
    )
    parser.add_argument("--option", type=parse_option, action="append", help="a method's knob, name=value")


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: ``priortr generate: error: ...``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # argparse reads "-1:128" as an unknown option and says "--stages: expected one argument"
        for token in args or []:
            if re.fullmatch(r"-\d+:\S*", token):
                self.error(f"argument --stages: a stage's layer is a decoder layer index >= 0, got {token!r}")
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one sub-parser per command, each dispatching to its ``cmd_*`` function."""
    parser = Parser(prog="priortr", description="Prior-corrected visual token pruning.")
    parser.add_argument("--version", action="version", version=f"priortr {priortr.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log diagnostics to stderr")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = commands.add_parser(
        "generate", help="answer a prompt about an image", description=cmd_generate.__doc__
    )
    add_model_arguments(gen)
    gen.add_argument("--method", default="priortr", help="a method of `priortr methods`")
    gen.add_argument(
        "--budget", type=parse_budget, help="kept tokens: count, or ratio in (0, 1) (default 64)"
    )
    add_layer_arguments(gen)
    gen.add_argument("--config", help=CONFIG_HELP + "; flags it sets differently are refused")
    gen.add_argument("--max-new-tokens", type=positive_int, default=32)
    gen.add_argument("--no-prune", action="store_true", help="run the stock model, for comparison")
    gen.set_defaults(func=cmd_generate)

    listing = commands.add_parser("methods", help="list every method", description=cmd_methods.__doc__)
    listing.add_argument("--json", action="store_true", help="print one JSON document")
    listing.set_defaults(func=cmd_methods)

    fl = commands.add_parser("flops", help="analytic FLOPs per term", description=cmd_flops.__doc__)
    fl.add_argument("--model", default="llava-1.5-7b", help="shipped config name or checkpoint directory")
    fl.add_argument("--budgets", type=parse_budget, nargs="+", default=[192, 128, 64])
    fl.add_argument("--methods", nargs="+", default=["priortr"], help="priortr, fastv or pdrop")
    fl.add_argument(
        "--layer",
        type=nonnegative_int,
        help="0-indexed decoder layer whose attention is scored (default: each method's own)",
    )
    fl.add_argument("--text-tokens", type=positive_int, default=48)
    fl.add_argument("--decode-steps", type=nonnegative_int, default=63)
    fl.add_argument(
        "--image-tokens", type=positive_int, help="visual tokens per image (default: the model's)"
    )
    fl.add_argument("--exact", action="store_true", help="count grouped-query K/V projections exactly")
    fl.add_argument("--config", help=CONFIG_HELP + "; replaces --methods, --budgets and --layer")
    fl.add_argument("--json", action="store_true", help="print one JSON document")
    fl.set_defaults(func=cmd_flops)

    bench = commands.add_parser(
        "bench", help="measure prefill, KV cache and throughput", description=cmd_bench.__doc__
    )
    bench.add_argument("--model", default="llava-1.5-7b", help="shipped config name or checkpoint directory")
    bench.add_argument(
        "--layers", type=positive_int, help="cut the language model to this many decoder layers"
    )
    bench.add_argument("--vision-layers", type=positive_int, help="cut the vision tower to this many layers")
    bench.add_argument("--methods", nargs="+", help="default: vanilla and every method")
    bench.add_argument("--budgets", type=positive_int, nargs="+", default=[192, 128, 64])
    bench.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 32])
    bench.add_argument("--layer", type=nonnegative_int, help=LAYER_HELP)
    bench.add_argument("--option", type=parse_option, action="append", help="a method's knob, name=value")
    bench.add_argument("--text-tokens", type=positive_int, default=48, help="text tokens around the image")
    bench.add_argument(
        "--new-tokens", type=positive_int, default=32, help="greedy tokens generated per sample"
    )
    bench.add_argument("--warmup", type=nonnegative_int, default=3)
    bench.add_argument(
        "--repeats",
        type=positive_int,
        default=10,
        help="timed prefill runs per configuration (quartiles from 5)",
    )
    bench.add_argument(
        "--decode-repeats", type=positive_int, default=3, help="timed generate() runs per configuration"
    )
    bench.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    bench.add_argument(
        "--dtype", choices=list(DTYPES), default="bfloat16" if torch.cuda.is_available() else "float32"
    )
    bench.add_argument("--attn", choices=cli_input.ATTENTION, default="sdpa", help="attention implementation")
    bench.add_argument(
        "--out", default="bench-out", help="folder for bench.jsonl (each measurement), bench.json, .md, .png"
    )
    bench.add_argument("--resume", action="store_true", help="continue the run recorded in --out")
    bench.add_argument("--config", help=CONFIG_HELP + "; vanilla against it, replacing the grid flags")
    bench.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    bench.set_defaults(func=cmd_bench)

    viz = commands.add_parser(
        "viz", help="draw prior, posterior and score maps over the image", description=cmd_viz.__doc__
    )
    add_model_arguments(viz)
    viz.add_argument("--method", default="priortr", help="a scoring-rule method of `priortr methods`")
    viz.add_argument(
        "--layers", type=nonnegative_int, nargs="+", default=[2], help="0-indexed scored layers, a row each"
    )
    viz.add_argument(
        "--budgets",
        type=parse_budget,
        nargs="+",
        default=[64],
        help="kept tokens: counts or ratios, a row each",
    )
    viz.add_argument("--config", help=CONFIG_HELP + "; replaces --method, --budgets and --layers")
    viz.add_argument("--out", required=True, help="path of the PNG to write (.png added if no suffix)")
    viz.set_defaults(func=cmd_viz)

    demo = commands.add_parser(
        "demo", help="the trained testbed: full model vs FastV vs PriorTR", description=cmd_demo.__doc__
    )
    demo.add_argument(
        "--budget", type=positive_int, help="visual tokens kept of 576 (default: the calibrated one)"
    )
    demo.add_argument(
        "--layer", type=nonnegative_int, help="0-indexed scored decoder layer (default: the calibrated one)"
    )
    demo.add_argument("--config", help=CONFIG_HELP + "; its layer and budget replace the calibrated ones")
    demo.add_argument("--out", default="priortr-demo.png", help="path of the PNG to write")
    demo.add_argument(
        "--save-image", metavar="PATH", help="only save the demo's scene image (to try generate and viz on)"
    )
    demo.set_defaults(func=cmd_demo)

    from priortr.testbed import data, evaluate

    ev = commands.add_parser(
        "eval", help="accuracy under pruning, methods x budgets", description=cmd_eval.__doc__
    )
    ev.add_argument("--split", choices=data.SPLITS, default="scenes-test")
    ev.add_argument("--limit", type=positive_int, help="a fixed random subset of this many questions")
    ev.add_argument("--model", default=TESTBED, help=f"{TESTBED}, or a checkpoint with a chat template")
    ev.add_argument("--methods", nargs="+", default=list(evaluate.DEFAULT_METHODS))
    ev.add_argument("--budgets", type=positive_int, nargs="+", default=list(evaluate.DEFAULT_BUDGETS))
    ev.add_argument(
        "--layer",
        type=nonnegative_int,
        help="0-indexed decoder layer scored by one-layer methods (default: each method's own)",
    )
    ev.add_argument("--batch-size", type=positive_int, default=8)
    ev.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ev.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ev.add_argument("--config", help=CONFIG_HELP + "; vanilla against it, replacing the grid flags")
    ev.add_argument(
        "--out", default="eval-out", help="folder for <split>.samples.jsonl (every answer), .json, .md, .png"
    )
    ev.add_argument("--resume", action="store_true", help="continue the run recorded in --out")
    ev.set_defaults(func=cmd_eval)

    cal = commands.add_parser(
        "calibrate",
        help="label-free: which method, layer and budget keep this model's answers",
        description=cmd_calibrate.__doc__,
    )
    cal.add_argument("--model", required=True, help=f"hub id, local checkpoint directory, or {TESTBED}")
    cal.add_argument(
        "--data",
        required=True,
        help=f'a folder holding prompts.jsonl (lines {{"image": PATH, "prompt": TEXT}}, paths relative to '
        f"the folder), or a testbed split: {', '.join(data.SPLITS)}",
    )
    cal.add_argument(
        "--limit", type=positive_int, help="the first N prompts of a folder, a fixed subset of a split"
    )
    cal.add_argument(
        "--methods", nargs="+", default=["fastv", "priortr"], help="methods of `priortr methods`"
    )
    cal.add_argument(
        "--layers", type=nonnegative_int, nargs="+", default=[2], help="scored layers of one-layer methods"
    )
    cal.add_argument("--budgets", type=parse_budget, nargs="+", default=[192, 128, 64, 32])
    cal.add_argument("--target", type=float, default=0.95, help="agreement a recommendation must reach")
    cal.add_argument(
        "--rank-by",
        choices=["speedup", "flops"],
        default="speedup",
        help="what fastest means: measured speed-up, or FLOPs share where timings are noisy",
    )
    cal.add_argument("--tokens", type=positive_int, default=4, help="answer tokens compared for agreement")
    cal.add_argument("--batch-size", type=positive_int, default=8)
    cal.add_argument(
        "--warmup", type=nonnegative_int, default=1, help="untimed prefills before timing each configuration"
    )
    cal.add_argument(
        "--repeats", type=positive_int, default=5, help="timed prefills per configuration (median)"
    )
    cal.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    cal.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: the checkpoint's")
    cal.add_argument("--out", default="calibration", help="folder for results, configs and the cache")
    cal.set_defaults(func=cmd_calibrate)

    rep = commands.add_parser(
        "report", help="the paper's table from lmms-eval results", description=cmd_report.__doc__
    )
    rep.add_argument("results", nargs="+", metavar="RESULT_DIR", help="lmms-eval --output_path folders")
    rep.add_argument("--baseline", default="vanilla", help="method label of the unpruned rows")
    rep.add_argument("--out", help="folder for table.md, table.csv and retention.png")
    rep.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; return 0, or 2 after printing ``priortr: error: ...`` for bad input."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or argparse's own usage error (already printed)
        return exc.code if isinstance(exc.code, int) else 0
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    log.setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    log.info("arguments: %s", {k: v for k, v in vars(args).items() if k != "func"})
    args.argv = argv
    try:
        cli_input.check(args)
        return args.func(args)
    except (ValueError, OSError) as exc:
        if args.debug:
            raise
        print(f"priortr: error: {cli_input.one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("priortr: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
