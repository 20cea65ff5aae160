"""Measured efficiency of pruning: prefill latency, KV cache, decode throughput, against a roofline.

Every number here is measured in the run that reports it (median of repeated runs after warm-up;
CUDA events on GPU, a monotonic clock on CPU), next to the limit the same machine allows: two
ceilings are measured in the same run (a large matmul's FLOP/s and a large copy's bytes/s) and each
configuration's language-model prefill is predicted as max(FLOPs / peak, bytes / bandwidth). The
paper's efficiency table (Appendix "Efficiency Analysis") reports prefill without the ViT and
projector; so does ``lm_prefill_ms`` here, with the image path timed separately.
"""

from __future__ import annotations

import platform
import resource
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

import priortr
from priortr import compat
from priortr.adapters import adapter_for
from priortr.configs import load_config
from priortr.flops import kv_cache_bytes, scheduled_prefill_flops

VANILLA = "vanilla"


@dataclass(frozen=True)
class Spread:
    """Median and spread of repeated timings, in milliseconds."""

    median: float
    q25: float
    q75: float
    minimum: float
    maximum: float
    runs: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        q25, _, q75 = statistics.quantiles(samples, n=4) if len(samples) > 1 else (samples[0],) * 3
        return cls(statistics.median(samples), q25, q75, min(samples), max(samples), len(samples))


@dataclass(frozen=True)
class Ceilings:
    """Peak rates measured on this machine in this run, for the roofline."""

    matmul_flops_per_s: float
    copy_bytes_per_s: float


@dataclass
class CaseResult:
    method: str
    budget: int | None
    batch: int
    lm_prefill_ms: Spread
    vision_ms: Spread
    overhead_ms: Spread | None
    kv_cache_bytes: int
    kv_cache_expected_bytes: int
    decode_s: Spread
    samples_per_s: float
    tokens_per_s: float
    peak_memory_bytes: int | None
    lm_flops: float
    predicted_ms: float
    speedup: float = 1.0
    limit_speedup: float = 1.0

    @property
    def limit_ratio(self) -> float:
        """How much of the speed-up the roofline allows was measured (1.0 = all of it)."""
        return self.speedup / self.limit_speedup


@dataclass
class BenchReport:
    meta: dict[str, Any]
    ceilings: Ceilings
    cases: list[CaseResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        rows = [{**asdict(case), "limit_ratio": case.limit_ratio} for case in self.cases]
        return {"meta": self.meta, "ceilings": asdict(self.ceilings), "cases": rows}


class Clock:
    """Named time marks: CUDA events on GPU (no synchronisation inside the measured region), a
    monotonic clock on CPU, where kernels run synchronously."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        if name in self.marks:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def elapsed_ms(self, start: str, end: str) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return self.marks[start].elapsed_time(self.marks[end])
        return (self.marks[end] - self.marks[start]) * 1e3


@contextmanager
def timing_hooks(model: nn.Module, clock_ref: list[Clock], stage_layers: Sequence[int]) -> Iterator[None]:
    """Marks around the image path, the language model and each pruning stage's scoring + surgery:
    from the end of layer L's own computation to the start of layer L+1's, or for a stage before the
    language model (L = -1) the engine's work in front of layer 0."""
    adapter = adapter_for(model)
    first, last = adapter.vision_modules(model)
    language = adapter.language_model(model)
    layers = adapter.decoder_layers(model)

    def at(name: str) -> Callable[..., None]:
        return lambda *_: clock_ref[0].mark(name)

    handles = [
        first.register_forward_pre_hook(at("vision_start")),
        last.register_forward_hook(at("vision_end")),
        language.register_forward_pre_hook(at("lm_start")),
        language.register_forward_hook(at("lm_end")),
    ]
    for stage, layer in enumerate(stage_layers):
        start, end = f"score_start_{stage}", f"score_end_{stage}"
        if layer < 0:
            handles.append(layers[0].register_forward_pre_hook(at(start), prepend=True))
            handles.append(layers[0].register_forward_pre_hook(at(end)))
        else:
            handles.append(layers[layer].register_forward_hook(at(start), prepend=True))
            handles.append(layers[layer + 1].register_forward_pre_hook(at(end)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def measure_ceilings(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> Ceilings:
    """Peak matmul FLOP/s and copy bandwidth of this device, median of ``repeats``."""
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul = _median_seconds(lambda: torch.matmul(a, b), device, repeats)
    size = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = _median_seconds(lambda: dst.copy_(src), device, repeats)
    return Ceilings(matmul_flops_per_s=2 * n**3 / matmul, copy_bytes_per_s=2 * size / copy)


def _median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        clock = Clock(device)
        clock.mark("a")
        fn()
        clock.mark("b")
        samples.append(clock.elapsed_ms("a", "b") / 1e3)
    return statistics.median(samples)


def build_model(
    name_or_path: str,
    device: torch.device,
    dtype: torch.dtype,
    layers: int | None = None,
    vision_layers: int | None = None,
    attn: str = "sdpa",
) -> nn.Module:
    """A shipped true-shape config (or a checkpoint directory) with random weights, created directly
    on ``device``; ``layers`` / ``vision_layers`` cut the depth so that big shapes fit a CPU run."""
    from transformers import AutoModelForImageTextToText

    config = load_config(name_or_path)
    if layers is not None:
        _cut_depth(config.text_config, "num_hidden_layers", layers)
    if vision_layers is not None:
        key = "depth" if hasattr(config.vision_config, "depth") else "num_hidden_layers"
        _cut_depth(config.vision_config, key, vision_layers)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


def _cut_depth(config: Any, key: str, depth: int) -> None:
    if depth < 1 or depth > getattr(config, key):
        raise ValueError(f"cannot cut {key}={getattr(config, key)} to {depth}")
    setattr(config, key, depth)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:depth]


@torch.inference_mode()
def run_case(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    method: str,
    budget: int | None,
    warmup: int,
    repeats: int,
    new_tokens: int,
    decode_repeats: int,
    layer: int | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Prefill timings, KV bytes, and end-to-end greedy generation for one configuration; ``layer`` is
    passed to one-layer methods only."""
    device = model.device
    if method == VANILLA:
        pruning = nullcontext()
    else:
        layer = layer if priortr.get_method(method).where == "layer" else None
        pruning = priortr.apply(model, method=method, budget=budget, layer=layer, options=options)
    n_visual = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
    n_layers = len(adapter_for(model).decoder_layers(model))
    stages = [] if method == VANILLA else pruning.config.plan(n_visual, n_layers)
    clock_ref = [Clock(device)]
    lm, vision, overhead = [], [], []
    with pruning, timing_hooks(model, clock_ref, [layer for layer, _ in stages]):
        for step in range(warmup + repeats):
            clock_ref[0] = Clock(device)
            output = model(**inputs, use_cache=True, logits_to_keep=1)
            if step < warmup:
                continue
            clock = clock_ref[0]
            lm.append(clock.elapsed_ms("lm_start", "lm_end"))
            vision.append(clock.elapsed_ms("vision_start", "vision_end"))
            if stages:
                overhead.append(
                    sum(clock.elapsed_ms(f"score_start_{i}", f"score_end_{i}") for i in range(len(stages)))
                )
        if stages:  # the tokens each stage left: SparseVLM recycles clusters on top of its counts
            stages = [(stage.layer, stage.kept.shape[1]) for stage in pruning.last.stages]
        cache = output.past_key_values
        kv_bytes = sum(
            t.numel() * t.element_size() for layer_ in cache.layers for t in (layer_.keys, layer_.values)
        )
        del output, cache
        decode, peak = _decode(model, inputs, new_tokens, decode_repeats)
    batch = inputs["input_ids"].shape[0]
    return {
        "lm_prefill_ms": Spread.of(lm),
        "vision_ms": Spread.of(vision),
        "overhead_ms": Spread.of(overhead) if overhead else None,
        "kv_cache_bytes": kv_bytes,
        "decode_s": Spread.of(decode),
        "samples_per_s": batch / statistics.median(decode),
        "tokens_per_s": batch * new_tokens / statistics.median(decode),
        "peak_memory_bytes": peak,
        "stages": stages,
    }


def _decode(
    model: nn.Module, inputs: dict[str, torch.Tensor], new_tokens: int, repeats: int
) -> tuple[list[float], int | None]:
    """Seconds of end-to-end greedy generation of exactly ``new_tokens`` tokens, and the GPU peak."""
    cuda = model.device.type == "cuda"
    options = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    model.generate(**inputs, **options)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(repeats):
        clock = Clock(model.device)
        clock.mark("a")
        model.generate(**inputs, **options)
        clock.mark("b")
        seconds.append(clock.elapsed_ms("a", "b") / 1e3)
    return seconds, torch.cuda.max_memory_allocated() if cuda else None


def lm_weight_bytes(model: nn.Module) -> int:
    """Bytes of the decoder layers' weights: what one prefill must read at least once."""
    layers = adapter_for(model).decoder_layers(model)
    return sum(p.numel() * p.element_size() for p in layers.parameters())


def predict_ms(flops: float, bytes_moved: float, ceilings: Ceilings) -> float:
    """Roofline time: the slower of computing at the measured peak and moving bytes at the measured
    bandwidth."""
    return 1e3 * max(flops / ceilings.matmul_flops_per_s, bytes_moved / ceilings.copy_bytes_per_s)


def run_bench(
    model: nn.Module,
    methods: Sequence[str],
    budgets: Sequence[int],
    batch_sizes: Sequence[int],
    layer: int | None = None,
    options: dict[str, Any] | None = None,
    text_tokens: int = 48,
    new_tokens: int = 32,
    warmup: int = 3,
    repeats: int = 10,
    decode_repeats: int = 3,
    seed: int = 0,
    progress: Callable[[Iterator], Iterator] = iter,
    meta: dict[str, Any] | None = None,
) -> BenchReport:
    """Every (method, budget, batch) configuration, vanilla first at each batch size."""
    config = model.config
    device, dtype = model.device, model.dtype
    adapter = adapter_for(model)
    report = BenchReport(meta=_meta(model, meta or {}), ceilings=measure_ceilings(device, dtype))
    cases = [(VANILLA, None, b) for b in batch_sizes]
    cases += [(m, k, b) for b in batch_sizes for m in methods if m != VANILLA for k in budgets]
    weights = lm_weight_bytes(model)
    baseline: dict[int, CaseResult] = {}
    for method, budget, batch in progress(cases):
        generator = torch.Generator().manual_seed(seed)
        inputs = compat.rename_image_argument(
            model, adapter.dummy_inputs(config, batch, text_tokens, generator)
        )
        inputs = {
            k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in inputs.items()
        }
        n_visual = int((inputs["input_ids"][0] == config.image_token_id).sum())
        seq = inputs["input_ids"].shape[1]
        measured = run_case(
            model, inputs, method, budget, warmup, repeats, new_tokens, decode_repeats, layer, options
        )
        stages = measured.pop("stages")
        kept = stages[-1][1] if stages else n_visual  # a schedule (SparseVLM) may end off the budget
        flops = batch * scheduled_prefill_flops(config, seq - n_visual, n_visual, stages, exact=True)
        expected_kv = kv_cache_bytes(config, seq - n_visual + kept, dtype.itemsize, batch, pruned_from=None)
        case = CaseResult(
            method=method,
            budget=budget,
            batch=batch,
            kv_cache_expected_bytes=expected_kv,
            lm_flops=flops,
            predicted_ms=predict_ms(flops, weights + expected_kv, report.ceilings),
            **measured,
        )
        if method == VANILLA:
            baseline[batch] = case
        else:
            base = baseline[batch]
            case.speedup = base.lm_prefill_ms.median / case.lm_prefill_ms.median
            case.limit_speedup = base.predicted_ms / case.predicted_ms
        report.cases.append(case)
    return report


def _meta(model: nn.Module, extra: dict[str, Any]) -> dict[str, Any]:
    device = model.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "device": name,
        "device_type": device.type,
        "dtype": str(model.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "priortr": priortr.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "text_layers": model.config.text_config.num_hidden_layers,
        "attn_implementation": model.config._attn_implementation,
        **extra,
    }


def peak_rss_bytes() -> int:
    """This process's peak resident memory (the CPU stand-in for a per-run peak)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def format_markdown(report: BenchReport) -> str:
    """One row per configuration: the measured numbers and the roofline limit beside them."""
    meta = report.meta
    lines = [
        f"device: {meta['device']} ({meta['device_type']}), dtype {meta['dtype']}, torch {meta['torch']}, "
        f"transformers {meta['transformers']}, text layers {meta['text_layers']}",
        f"ceilings: matmul {report.ceilings.matmul_flops_per_s / 1e12:.2f} TFLOP/s, "
        f"copy {report.ceilings.copy_bytes_per_s / 1e9:.1f} GB/s",
        "",
        "| method | K | batch | LM prefill ms (median [q25, q75]) | ViT+proj ms | scoring+surgery ms "
        "| KV MiB | samples/s | tokens/s | speed-up | roofline limit | of limit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in report.cases:
        p = c.lm_prefill_ms
        overhead = f"{c.overhead_ms.median:.3f}" if c.overhead_ms else "-"
        lines.append(
            f"| {c.method} | {c.budget if c.budget is not None else 'all'} | {c.batch} "
            f"| {p.median:.2f} [{p.q25:.2f}, {p.q75:.2f}] | {c.vision_ms.median:.2f} | {overhead} "
            f"| {c.kv_cache_bytes / 2**20:.1f} | {c.samples_per_s:.2f} | {c.tokens_per_s:.1f} "
            f"| {c.speedup:.2f}x | {c.limit_speedup:.2f}x | {c.limit_ratio:.0%} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: BenchReport, path: Path) -> None:
    """Speed-up vs budget, measured (solid) and roofline limit (dashed), one colour per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    methods = sorted({c.method for c in report.cases if c.method != VANILLA})
    batches = sorted({c.batch for c in report.cases})
    for i, batch in enumerate(batches):
        colour = f"C{i}"
        limit_drawn = False
        for j, method in enumerate(methods):
            rows = sorted(
                (c for c in report.cases if c.method == method and c.batch == batch), key=lambda c: c.budget
            )
            budgets = [c.budget for c in rows]
            ax.plot(
                budgets,
                [c.speedup for c in rows],
                marker="os^vD<>p"[j % 8],
                color=colour,
                label=f"{method}, batch {batch}",
            )
            if not limit_drawn:
                ax.plot(
                    budgets,
                    [c.limit_speedup for c in rows],
                    linestyle="--",
                    color=colour,
                    label=f"roofline limit, batch {batch}",
                )
                limit_drawn = True
    ax.set_xlabel("kept visual tokens K")
    ax.set_ylabel("LM prefill speed-up over vanilla")
    ax.set_title(
        f"{report.meta.get('model', '')} ({report.meta['text_layers']} text layers) "
        f"on {report.meta['device']} ({report.meta['dtype']})",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
