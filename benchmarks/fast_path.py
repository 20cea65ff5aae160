"""Issue 47's measurements in one run, on the LLaVA-1.5-7B shape with random weights: the batch-1 prefill
(wall and host-enqueue ms), the compiled prefill (``model.compile()``, vanilla and pruned), the compiled
static-cache decode step at batch 1 / 8 / 32, and the syncs of a prefill and of a decode step, as CUDA
reports them (``torch.cuda.set_sync_debug_mode``) beside what the CPU counter predicts
(``priortr.tools.overhead``).

    python benchmarks/fast_path.py --device cuda --out DIR        (scripts/gpu-check.sh runs it)
    python benchmarks/fast_path.py --device cpu --model TINY --batch-sizes 1 --new-tokens 3 --out DIR
        (gpu-check.sh --tiny: TINY is the smaller LLaVA of scripts/tiny_model.py; proves the script)

The tiny run changes sizes only (the model's depth and width, batch sizes, repeats, new tokens): the
scored layer, the method and every step are the GPU run's, so a CPU run fails where the GPU run would.

Each row is written to ``DIR/fast.jsonl`` as it finishes (a run cut short keeps the rows it made), and
the tables to ``DIR/fast.md``. The host-enqueue time is how long the forward call takes to return on the
host, the wall time how long until the device has finished it: where they are equal the forward is
host-bound, and removing tokens cannot speed it up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import priortr
from priortr.adapters import adapter_for
from priortr.cli import checks
from priortr.frontend import timing
from priortr.tools import overhead
from priortr.tools.bench import bench_config, build_model
from priortr.tools.families import dummy_inputs


def inputs(model: nn.Module, batch: int, text_tokens: int, device: torch.device) -> dict:
    """One image per row, ``text_tokens`` text tokens, on ``device`` (pixels in the model's dtype)."""
    generator = torch.Generator().manual_seed(0)
    made = dummy_inputs(adapter_for(model), model.config, batch, text_tokens, generator)
    return {
        name: value.to(device, model.dtype if value.is_floating_point() else value.dtype)
        for name, value in made.items()
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def prefill_times(model: nn.Module, batch: dict, repeats: int) -> dict[str, float]:
    """Median and quartiles of ``repeats`` prefills' wall ms, and the median host-enqueue ms."""
    wall, host = [], []
    for _ in range(repeats):
        synchronize(model.device)
        start = time.perf_counter()
        with torch.no_grad():
            model(**batch, logits_to_keep=1)
        enqueued = time.perf_counter()
        synchronize(model.device)
        wall.append((time.perf_counter() - start) * 1e3)
        host.append((enqueued - start) * 1e3)
    quartiles = statistics.quantiles(wall, n=4) if len(wall) > 1 else [wall[0]] * 3
    return {
        "wall_ms": statistics.median(wall),
        "q1_ms": quartiles[0],
        "q3_ms": quartiles[2],
        "host_ms": statistics.median(host),
        "repeats": repeats,
    }


@contextlib.contextmanager
def pruned(model: nn.Module, budget: int | None, layer: int) -> Iterator[None]:
    """PriorTR at ``budget`` within the block (None: vanilla)."""
    if budget is None:
        yield
        return
    with priortr.apply(model, method="priortr", budget=budget, layer=layer):
        yield


def decode_step_ms(model: nn.Module, batch: dict, new_tokens: int, compile_config: Any) -> float:
    """Median ms of a compiled static-cache decode step (``generate``'s own compile), after a warm-up."""
    options = {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "cache_implementation": "static",
        "compile_config": compile_config,
    }
    with torch.no_grad():
        model.generate(**batch, **options)  # compiles
        with timing.forward_calls_ms(model) as calls:
            model.generate(**batch, **options)
    return statistics.median(calls[1:])


def cuda_syncs(model: nn.Module, batch: dict) -> tuple[int, int] | None:
    """Syncs CUDA reports in the prefill and in the first decode step of a 3-token ``generate``."""
    if model.device.type != "cuda":
        return None
    windows = [0]  # syncs before the first call, then one window per model call
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        seen = 0

        def count(*_: Any) -> None:  # the syncs since the last call: the window that just ended
            nonlocal seen
            windows[-1] += sum("synchroniz" in str(w.message) for w in caught[seen:])
            seen = len(caught)

        def on_call(*_: Any) -> None:
            count()
            windows.append(0)

        handle = model.register_forward_pre_hook(on_call)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.generate(**batch, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            handle.remove()
    return windows[1], windows[2]


def compiled_counts(fn: Callable[[], Any]) -> dict[str, int]:
    """Graphs dynamo made and graph breaks it took while ``fn`` ran (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    counters.clear()
    fn()
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


def check(model: str, budget: int, layer: int) -> None:
    """What ``priortr.apply`` says of PriorTR at ``budget`` and ``layer`` on ``model`` (a shipped config
    name or a config directory), read from a weightless skeleton: a bad layer fails here, before any
    model is built."""
    checks.check_pruning(checks.skeleton(bench_config(model)), method="priortr", budget=budget, layer=layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="llava-1.5-7b", help="shipped config name or config directory")
    parser.add_argument("--out", default="fast-out")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=16, help="of each compiled static decode")
    args = parser.parse_args()
    if 1 not in args.batch_sizes:
        parser.error("--batch-sizes must include 1 (the prefill and sync rows are batch 1)")
    check(args.model, args.budget, args.layer)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = build_model(args.model, device, dtype)
    batches = {size: inputs(model, size, 48, device) for size in sorted(set(args.batch_sizes))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "fast.jsonl").open("w") as journal:
        rows = measure(
            model,
            batches,
            args.budget,
            args.layer,
            args.repeats,
            args.new_tokens,
            lambda row: print(json.dumps(row), file=journal, flush=True),
        )
    (out / "fast.md").write_text(markdown(rows))
    print(markdown(rows))


def measure(
    model: nn.Module,
    batches: dict[int, dict],
    budget: int,
    layer: int,
    repeats: int,
    new_tokens: int,
    record: Callable[[dict], None] = print,
) -> list[dict]:
    """Every row, each handed to ``record`` as it finishes: vanilla and PriorTR at ``budget`` (scored at
    ``layer``) on ``batches`` (batch size -> inputs; batch 1 for the prefill and sync rows). Compiles
    with inductor on CUDA, with dynamo's eager backend elsewhere (graphs and breaks, no speed)."""
    backend = "inductor" if model.device.type == "cuda" else "eager"
    one = batches[1]
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        record(row)

    for kept in (None, budget):
        with pruned(model, kept, layer):
            prefill_times(model, one, 3)  # warm-up
            add({"what": "eager prefill, batch 1", "K": kept, **prefill_times(model, one, repeats)})
            syncs = cuda_syncs(model, one)
            calls = overhead.count_generate(model, one)
            add(
                {
                    "what": "syncs",
                    "K": kept,
                    "cuda_prefill": None if syncs is None else syncs[0],
                    "cuda_decode_step": None if syncs is None else syncs[1],
                    "predicted_prefill": calls[0].syncs,
                    "predicted_decode_step": overhead.decode_step(calls).syncs,
                    "predicted_prefill_h2d": calls[0].h2d,
                }
            )
    from transformers import CompileConfig

    config = CompileConfig(backend=backend, fullgraph=False)
    config._compile_all_devices = True  # transformers' own switch to compile on CPU too (private)
    for batch_size, batch in batches.items():
        for kept in (None, budget):
            torch._dynamo.reset()
            with pruned(model, kept, layer):
                step = decode_step_ms(model, batch, new_tokens, config)
            add({"what": f"compiled static decode step, batch {batch_size}", "K": kept, "step_ms": step})
    torch._dynamo.reset()
    model.compile(backend=backend)
    try:
        for kept in (None, budget):
            with pruned(model, kept, layer):
                counts = compiled_counts(lambda: prefill_times(model, one, 2))  # compiles
                again = compiled_counts(lambda: prefill_times(model, one, 1))
                add(
                    {
                        "what": "compiled prefill, batch 1",
                        "K": kept,
                        **prefill_times(model, one, repeats),
                        **counts,
                        "recompiled_graphs": again["graphs"],
                    }
                )
    finally:
        model._compiled_call_impl = None  # nn.Module.compile's own attribute: the eager model again
        torch._dynamo.reset()
    return rows


def markdown(rows: list[dict]) -> str:
    """One table per kind of row, its columns the rows' keys."""
    out, kinds = [], {}
    for row in rows:
        kinds.setdefault(row["what"], []).append(row)
    for what, group in kinds.items():
        columns = [key for key in group[0] if key != "what"]
        out += [f"\n### {what}\n", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        for row in group:
            cells = [f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
