"""Under a steady stream of image requests, how many engine steps take the plug-in's pruned path (run
eagerly, outside vLLM's compiled pieces and CUDA graphs on a GPU), and the decode time per output
token (TPOT) of long text-only requests sharing those steps (docs/serving.md, "Keeping vLLM's fast
path in a pruned step").

    .venv-vllm/bin/python benchmarks/vllm_eager_share.py [--layers 6] [--hidden 512] [--text 4]
        [--tokens 96] [--every 6 2] [--repeats 3] [--out benchmarks/results/vllm-eager-share]

The model is ``vllm_serving.py``'s random LLaVA-1.5 layout (576 visual tokens per image), built
offline; one engine with the plug-in (PriorTR at ``--layer``, K = ``--budget``). ``--text`` text-only
requests decode ``--tokens`` tokens each while an image request (8 output tokens) arrives every
``--every`` engine steps (each rate a stream of its own), in three modes: no arrivals, pruned
arrivals, unpruned arrivals (the request turns pruning off). A step takes the pruned path when
``PruningModel.forward`` hands it to the pruned step (``step.run_step``, as ``models`` calls it); both
are wrapped in this process to count calls. TPOT: per text request, (time of its last token - time of
its first) / (tokens - 1), the median over text requests. Runs alternate within each of
``--repeats`` repeats; the median over repeats is reported with its spread, flagged where the spread
is above 10% of the median. On vLLM's CPU build (``enforce_eager``) every step runs eagerly and there
are no CUDA graphs: the count shows the share of steps that would leave them on a GPU, not what that
costs there.

Writes ``eager-share.json`` and ``eager-share.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the ``benchmarks`` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.vllm_serving import (  # first: sets vLLM's environment before vLLM loads
    EngineArgs,
    LLMEngine,
    SamplingParams,
    build_checkpoint,
    cpu_name,
    question,
    request,
)
from priortr.integrations.vllm import models
from priortr.integrations.vllm.models import PruningModel

MODES = ("none", "pruned", "unpruned")
"""What arrives while the text requests decode: nothing, pruned image requests, unpruned ones."""
IMAGE_TOKENS = 8
"""Output tokens of each arriving image request."""

calls = {"steps": 0, "pruned": 0}
seeds = itertools.count(1)
"""Each arriving image is new (no processor- or encoder-cache hit across runs)."""


def counting(method: Any, key: str) -> Any:
    """``method`` counting its calls in ``calls[key]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[key] += 1
        return method(*args, **kwargs)

    return wrapper


PruningModel.forward = counting(PruningModel.forward, "steps")
models.run_step = counting(models.run_step, "pruned")


def start_engine(path: Path, args: argparse.Namespace) -> LLMEngine:
    engine_args = EngineArgs(
        model=str(path),
        dtype="float32",
        seed=0,
        max_model_len=1024,
        max_num_batched_tokens=8192,
        max_num_seqs=64,
        enforce_eager=True,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        hf_overrides={"priortr": {"method": "priortr", "budget": args.budget, "layer": args.layer}},
    )
    return LLMEngine.from_engine_args(engine_args)


def arrival(mode: str, text: str, seed: int) -> dict:
    """An image request of ``mode``: pruned at the engine's K, or with pruning off."""
    item = request(text, seed, None)
    if mode == "unpruned":
        item["mm_processor_kwargs"] = {"priortr": {"enabled": False}}
    return item


def run(engine: LLMEngine, mode: str, every: int, args: argparse.Namespace, tag: str) -> dict:
    """One run of ``mode`` with an arrival every ``every`` steps: the text requests' median TPOT
    (ms) and the steps counted."""
    text = {"prompt": f"<s>USER: {question(args.text_words)} ASSISTANT:"}
    long = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    short = SamplingParams(max_tokens=IMAGE_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    for index in range(args.text):
        engine.add_request(f"{tag}-text-{index}", text, long)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    calls.update(steps=0, pruned=0)
    step = arrivals = 0
    while engine.has_unfinished_requests():
        if mode != "none" and step % every == 0 and len(last) < args.text:
            arrivals += 1
            engine.add_request(f"{tag}-image-{arrivals}", arrival(mode, question(12), next(seeds)), short)
        outputs = engine.step()
        now = time.perf_counter()
        step += 1
        for output in outputs:
            if "-text-" in output.request_id:
                first.setdefault(output.request_id, now)
                if output.finished:
                    last[output.request_id] = now
    tpot = [(last[name] - first[name]) * 1000 / (args.tokens - 1) for name in first]
    return {
        "tpot_ms": statistics.median(tpot),
        "steps": calls["steps"],
        "pruned_steps": calls["pruned"],
        "arrivals": arrivals,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="text width (a multiple of 128)")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers")
    parser.add_argument("--layer", type=int, default=2, help="the scored layer L")
    parser.add_argument("--budget", type=int, default=64, help="K of a pruned image")
    parser.add_argument("--text", type=int, default=4, help="text-only requests decoding")
    parser.add_argument("--text-words", type=int, default=40, help="words of a text request's prompt")
    parser.add_argument("--tokens", type=int, default=96, help="output tokens per text request")
    parser.add_argument(
        "--every", type=int, nargs="+", default=[6, 2], help="engine steps between image arrivals"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm-eager-share"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        engine = start_engine(build_checkpoint(Path(folder), args.hidden, args.layers, seed=0), args)
        for mode in MODES:  # warm-up
            run(engine, mode, 2, argparse.Namespace(**{**vars(args), "tokens": 8}), f"warm-{mode}")
        runs: dict[str, list[dict]] = {f"{every}/{mode}": [] for every in args.every for mode in MODES}
        for repeat in range(args.repeats):
            for name in runs:
                every, mode = name.split("/")
                runs[name].append(run(engine, mode, int(every), args, f"{repeat}-{name}"))
    report = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "args": {key: str(value) for key, value in vars(args).items()},
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eager-share.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "eager-share.md").write_text(table + "\n")
    print(table)


def markdown(report: dict) -> str:
    """The report as a markdown table, one row per arrival rate and mode."""
    lines = [
        f"vLLM CPU build (enforce_eager, no CUDA graphs), {report['date']}, {report['cpu']}, "
        f"{report['cores']} cores shared with other work; median of the repeats [min, max]; "
        "* = repeats spread more than 10% (noise-prone). Our CPU numbers, not a GPU's.",
        "",
        "| an image every | arriving | image requests | steps | pruned-path steps | share "
        "| text TPOT ms | vs none |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in report["runs"].items():
        every, mode = name.split("/")
        base = statistics.median(run["tpot_ms"] for run in report["runs"][f"{every}/none"])
        tpot = [run["tpot_ms"] for run in runs]
        middle = statistics.median(tpot)
        flag = " *" if (max(tpot) - min(tpot)) > 0.1 * middle else ""
        steps = statistics.median(run["steps"] for run in runs)
        pruned = statistics.median(run["pruned_steps"] for run in runs)
        arrivals = statistics.median(run["arrivals"] for run in runs)
        lines.append(
            f"| {every} steps | {mode} | {arrivals:.0f} | {steps:.0f} | {pruned:.0f} | {pruned / steps:.0%} "
            f"| {middle:.1f} [{min(tpot):.1f}, {max(tpot):.1f}]{flag} | {middle / base:.2f}x |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
