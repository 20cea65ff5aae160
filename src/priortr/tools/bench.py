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
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

import priortr
from priortr import compat
from priortr.adapters import adapter_for
from priortr.frontend.configs import load_config
from priortr.frontend.timing import Clock, median_seconds
from priortr.tools import families
from priortr.tools.flops import kv_cache_bytes, scheduled_prefill_flops
from priortr.tools.journal import Journal
from priortr.tools.report import VANILLA

MIN_QUARTILE_RUNS = 5  # below this, quartiles of a handful of timings say nothing: none are reported


@dataclass(frozen=True)
class Spread:
    """Median and spread of repeated timings, in milliseconds. Quartiles (the inclusive estimator,
    linear between order statistics, so always within [minimum, maximum]) only from
    ``MIN_QUARTILE_RUNS`` runs on."""

    median: float
    q25: float | None
    q75: float | None
    minimum: float
    maximum: float
    runs: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        if len(samples) >= MIN_QUARTILE_RUNS:
            q25, _, q75 = statistics.quantiles(samples, n=4, method="inclusive")
        else:
            q25 = q75 = None
        return cls(statistics.median(samples), q25, q75, min(samples), max(samples), len(samples))

    @property
    def width(self) -> float:
        """The interquartile range, or the whole range when there are no quartiles."""
        return self.q75 - self.q25 if self.q25 is not None else self.maximum - self.minimum

    def __str__(self) -> str:
        if self.q25 is not None:
            return f"{self.median:.2f} [{self.q25:.2f}, {self.q75:.2f}]"
        return f"{self.median:.2f} (range {self.minimum:.2f}-{self.maximum:.2f}, {self.runs} runs)"


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
    resolved: bool = True  # the prefill medians differ by more than the spread of either side

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


@contextmanager
def timing_hooks(model: nn.Module, clock_ref: list[Clock]) -> Iterator[None]:
    """Marks around the image path (vision tower to projector) and the language model's forward."""
    adapter = adapter_for(model)
    first, last = adapter.vision_modules(model)
    language = adapter.language_model(model)

    def at(name: str) -> Callable[..., None]:
        return lambda *_: clock_ref[0].mark(name)

    handles = [
        first.register_forward_pre_hook(at("vision_start")),
        last.register_forward_hook(at("vision_end")),
        language.register_forward_pre_hook(at("lm_start")),
        language.register_forward_hook(at("lm_end")),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def stage_marks(handle: priortr.PruningHandle, clock_ref: list[Clock]) -> AbstractContextManager[None]:
    """Marks ``stage_start_L`` / ``stage_end_L`` around all of the work of the stage scored at layer L
    (evidence, decision, cut, cache compaction, the next layer's RoPE and mask), placed by the engine
    itself (``observe_stages``), so they bracket the stage whatever order the model's hooks were
    registered in."""
    return handle.observe_stages(lambda event, layer: clock_ref[0].mark(f"stage_{event}_{layer}"))


def measure_ceilings(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> Ceilings:
    """Peak matmul FLOP/s and copy bandwidth of this device, median of ``repeats``."""
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul = median_seconds(lambda: torch.matmul(a, b), device, repeats)
    size = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = median_seconds(lambda: dst.copy_(src), device, repeats)
    return Ceilings(matmul_flops_per_s=2 * n**3 / matmul, copy_bytes_per_s=2 * size / copy)


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

    config = bench_config(name_or_path, layers, vision_layers)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


def bench_config(name_or_path: str, layers: int | None = None, vision_layers: int | None = None) -> Any:
    """The config ``build_model`` builds: a shipped or local config, cut to ``layers`` decoder layers
    and ``vision_layers`` vision layers."""
    config = load_config(name_or_path)
    if layers is not None:
        _cut_depth(config.text_config, "num_hidden_layers", layers, "--layers")
    if vision_layers is not None:
        key = "depth" if hasattr(config.vision_config, "depth") else "num_hidden_layers"
        _cut_depth(config.vision_config, key, vision_layers, "--vision-layers")
    return config


def _cut_depth(config: Any, key: str, depth: int, option: str) -> None:
    if depth < 1 or depth > getattr(config, key):
        raise ValueError(f"{option} {depth}: the model has {getattr(config, key)} ({key}); give 1 to that")
    setattr(config, key, depth)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:depth]


def lm_weight_bytes(model: nn.Module) -> int:
    """Bytes of the decoder layers' weights: what one prefill must read at least once."""
    layers = adapter_for(model).decoder_layers(model)
    return sum(p.numel() * p.element_size() for p in layers.parameters())


def predict_ms(flops: float, bytes_moved: float, ceilings: Ceilings) -> float:
    """Roofline time: the slower of computing at the measured peak and moving bytes at the measured
    bandwidth."""
    return 1e3 * max(flops / ceilings.matmul_flops_per_s, bytes_moved / ceilings.copy_bytes_per_s)


Case = tuple[str, "int | None", int]  # (method, budget, batch)
Step = tuple  # ("setup", case) | ("prefill", case, round) | ("decode_warmup", case) | ("decode", case, round)


def rotated(group: Sequence[Case], round_: int) -> list[Case]:
    """The order of ``group`` in one round: each round starts one configuration later, so over
    len(group) rounds every configuration runs in every position once and drift or warm-up carried
    over from the previous configuration cancels out of the comparison."""
    shift = round_ % len(group)
    return [*group[shift:], *group[:shift]]


def schedule(cases: Sequence[Case], repeats: int, decode_repeats: int, done: set[tuple]) -> list[Step]:
    """Every step still to run, configurations interleaved round by round within each batch size;
    ``done`` holds the ("setup" | "prefill" | "decode", case[, round]) keys already recorded."""
    steps: list[Step] = []
    for batch in dict.fromkeys(case[2] for case in cases):
        group = [case for case in cases if case[2] == batch]
        prefill = [("prefill", c, r) for r in range(repeats) for c in rotated(group, r)]
        decode = [("decode", c, r) for r in range(decode_repeats) for c in rotated(group, r)]
        prefill = [step for step in prefill if step not in done]
        decode = [step for step in decode if step not in done]
        steps += [("setup", c) for c in group if ("setup", c) not in done or any(s[1] == c for s in prefill)]
        steps += prefill
        steps += [("decode_warmup", c) for c in group if any(s[1] == c for s in decode)]
        steps += decode
    return steps


class Bench:
    """One ``run_bench`` run: its measurements so far, recorded in ``journal`` as they finish, and
    the report of every configuration fully measured (after an interrupt: the table of what finished)."""

    def __init__(
        self,
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
        meta: dict[str, Any] | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.model, self.layer, self.options = model, layer, options
        self.text_tokens, self.new_tokens, self.seed = text_tokens, new_tokens, seed
        self.warmup, self.repeats, self.decode_repeats = warmup, repeats, decode_repeats
        self.cases: list[Case] = [(VANILLA, None, b) for b in batch_sizes]
        self.cases += [(m, k, b) for b in batch_sizes for m in methods if m != VANILLA for k in budgets]
        self.journal = journal
        self.records: dict[tuple, dict[str, Any]] = {}
        ceilings = None
        for record in journal.records if journal is not None else []:
            if record["kind"] == "ceilings":
                ceilings = Ceilings(**record["ceilings"])
            else:
                self.records[_key(record)] = record
        self._keep_recorded()
        if ceilings is None:
            ceilings = measure_ceilings(model.device, model.dtype)
            self._record({"kind": "ceilings", "ceilings": asdict(ceilings)})
        self.meta = _meta(model, meta or {})
        self.ceilings = ceilings
        self.n_visual = int((self._inputs(1)["input_ids"][0] == model.config.image_token_id).sum())

    def _keep_recorded(self) -> None:
        """A resumed run keeps (and finishes) every configuration and repeat it recorded, so that its
        outputs hold every result its record holds."""
        cases = list(dict.fromkeys([*self.cases, *(key[1] for key in self.records)]))
        self.cases = [c for c in cases if c[0] == VANILLA] + [c for c in cases if c[0] != VANILLA]
        rounds = [(key[0], key[2] + 1) for key in self.records if key[0] != "setup"]
        self.repeats = max([self.repeats, *(n for kind, n in rounds if kind == "prefill")])
        self.decode_repeats = max([self.decode_repeats, *(n for kind, n in rounds if kind == "decode")])

    def run(self, progress: Callable[[Iterator], Iterator] = iter) -> None:
        done = set(self.records)
        inputs_of: dict[int, dict[str, torch.Tensor]] = {}
        for step in progress(iter(schedule(self.cases, self.repeats, self.decode_repeats, done))):
            kind, case = step[0], step[1]
            batch = case[2]
            if batch not in inputs_of:
                inputs_of.clear()
                inputs_of[batch] = self._inputs(batch)
            getattr(self, f"_{kind}")(case, inputs_of[batch], *step[2:])

    def _inputs(self, batch: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        adapter = adapter_for(self.model)
        inputs = compat.inputs.rename_image_argument(
            self.model, families.dummy_inputs(adapter, self.model.config, batch, self.text_tokens, generator)
        )
        device, dtype = self.model.device, self.model.dtype
        return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in inputs.items()}

    @contextmanager
    def _attached(self, case: Case) -> Iterator[tuple[list[Clock], list[tuple[int, int]], Any]]:
        method, budget, _ = case
        if method == VANILLA:
            pruning, stages = nullcontext(), []
        else:
            layer = self.layer if priortr.get_method(method).where == "layer" else None
            pruning = priortr.apply(
                self.model, method=method, budget=budget, layer=layer, options=self.options
            )
            stages = pruning.config.schedule(
                self.n_visual, len(adapter_for(self.model).decoder_layers(self.model))
            )
        clock_ref = [Clock(self.model.device)]
        with (
            pruning as handle,
            timing_hooks(self.model, clock_ref),
            stage_marks(handle, clock_ref) if handle is not None else nullcontext(),
            torch.inference_mode(),
        ):
            yield clock_ref, stages, handle

    def _setup(self, case: Case, inputs: dict[str, torch.Tensor]) -> None:
        """Warm-up prefills, and once the KV cache bytes that a prefill leaves."""
        with self._attached(case) as (_, stages, handle):
            for _ in range(self.warmup):
                self.model(**inputs, use_cache=True, logits_to_keep=1)
            if ("setup", case) not in self.records:
                cache = compat.cache.of_output(self.model(**inputs, use_cache=True, logits_to_keep=1))
                if stages:  # the tokens each stage left: SparseVLM recycles clusters on top of its counts
                    stages = [(stage.layer, stage.kept.shape[1]) for stage in handle.last.stages]
                kv = compat.cache.byte_size(cache)
                setup = {"kind": "setup", "case": list(case), "kv_cache_bytes": kv, "stages": stages}
                self._record({**setup, "sequence": inputs["input_ids"].shape[1]})

    def _prefill(self, case: Case, inputs: dict[str, torch.Tensor], round_: int) -> None:
        with self._attached(case) as (clock_ref, stages, _):
            clock_ref[0] = clock = Clock(self.model.device)
            self.model(**inputs, use_cache=True, logits_to_keep=1)
            marks = [(f"stage_start_{layer}", f"stage_end_{layer}") for layer, _ in stages]
            overhead = sum(clock.elapsed_ms(start, end) for start, end in marks)
            record = {
                "kind": "prefill",
                "case": list(case),
                "round": round_,
                "lm_ms": clock.elapsed_ms("lm_start", "lm_end"),
                "vision_ms": clock.elapsed_ms("vision_start", "vision_end"),
                "overhead_ms": overhead if stages else None,
            }
        self._record(record)

    def _generate_options(self) -> dict[str, Any]:
        return {"max_new_tokens": self.new_tokens, "min_new_tokens": self.new_tokens, "do_sample": False}

    def _decode_warmup(self, case: Case, inputs: dict[str, torch.Tensor]) -> None:
        """An untimed generation before a case's timed ones (the ``decode_warmup`` step of ``run``)."""
        with self._attached(case):
            self.model.generate(**inputs, **self._generate_options())

    def _decode(self, case: Case, inputs: dict[str, torch.Tensor], round_: int) -> None:
        """Seconds of end-to-end greedy generation of exactly ``new_tokens`` tokens, and the GPU peak."""
        cuda = self.model.device.type == "cuda"
        with self._attached(case):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            clock = Clock(self.model.device)
            clock.mark("a")
            self.model.generate(**inputs, **self._generate_options())
            clock.mark("b")
            seconds = clock.elapsed_ms("a", "b") / 1e3
        peak = torch.cuda.max_memory_allocated() if cuda else None
        self._record(
            {"kind": "decode", "case": list(case), "round": round_, "seconds": seconds, "peak": peak}
        )

    def _record(self, record: dict[str, Any]) -> None:
        if record["kind"] != "ceilings":
            self.records[_key(record)] = record
        if self.journal is not None:
            self.journal.append(record)

    def report(self) -> BenchReport:
        """Every configuration whose measurements are all recorded, vanilla first at each batch size."""
        report = BenchReport(meta=self.meta, ceilings=self.ceilings)
        weights = lm_weight_bytes(self.model)
        baseline: dict[int, CaseResult] = {}
        for case in self.cases:
            setup = self.records.get(("setup", case))
            prefill = [self.records.get(("prefill", case, r)) for r in range(self.repeats)]
            decode = [self.records.get(("decode", case, r)) for r in range(self.decode_repeats)]
            if setup is None or None in prefill or None in decode:
                continue
            result = case_result(self.model, case, setup, prefill, decode, self.n_visual, self.new_tokens)
            result.predicted_ms = predict_ms(
                result.lm_flops, weights + result.kv_cache_expected_bytes, self.ceilings
            )
            if case[0] == VANILLA:
                baseline[case[2]] = result
            elif case[2] in baseline:
                compare(baseline[case[2]], result)
            else:
                result.speedup = result.limit_speedup = float("nan")
            report.cases.append(result)
        return report


def _key(record: dict[str, Any]) -> tuple:
    case = tuple(record["case"])
    return (record["kind"], case) if record["kind"] == "setup" else (record["kind"], case, record["round"])


def case_result(
    model: nn.Module,
    case: Case,
    setup: dict[str, Any],
    prefill: list[dict[str, Any]],
    decode: list[dict[str, Any]],
    n_visual: int,
    new_tokens: int,
) -> CaseResult:
    """One configuration's row from its recorded measurements."""
    method, budget, batch = case
    config = model.config
    stages = [tuple(stage) for stage in setup["stages"]]
    seq = setup["sequence"]
    kept = stages[-1][1] if stages else n_visual  # a schedule (SparseVLM) may end below the budget
    flops = batch * scheduled_prefill_flops(config, seq - n_visual, n_visual, stages, exact=True)
    overheads = [r["overhead_ms"] for r in prefill if r["overhead_ms"] is not None]
    seconds = [r["seconds"] for r in decode]
    peaks = [r["peak"] for r in decode if r["peak"] is not None]
    return CaseResult(
        method=method,
        budget=budget,
        batch=batch,
        lm_prefill_ms=Spread.of([r["lm_ms"] for r in prefill]),
        vision_ms=Spread.of([r["vision_ms"] for r in prefill]),
        overhead_ms=Spread.of(overheads) if overheads else None,
        kv_cache_bytes=setup["kv_cache_bytes"],
        kv_cache_expected_bytes=kv_cache_bytes(
            config, seq - n_visual + kept, model.dtype.itemsize, batch, pruned_from=None
        ),
        decode_s=Spread.of(seconds),
        samples_per_s=batch / statistics.median(seconds),
        tokens_per_s=batch * new_tokens / statistics.median(seconds),
        peak_memory_bytes=max(peaks) if peaks else None,
        lm_flops=flops,
        predicted_ms=0.0,
    )


def compare(base: CaseResult, case: CaseResult) -> None:
    """The speed-up of ``case`` over ``base`` (ratio of medians), its roofline limit, and whether it is
    ``resolved`` by the timings."""
    case.speedup = base.lm_prefill_ms.median / case.lm_prefill_ms.median
    case.limit_speedup = base.predicted_ms / case.predicted_ms
    case.resolved = resolved(base.lm_prefill_ms, case.lm_prefill_ms)


def resolved(base: Spread, case: Spread) -> bool:
    """Whether two timings' medians differ by more than the spread of either side: a speed-up that
    is not resolved is within noise."""
    return abs(base.median - case.median) > max(base.width, case.width)


def interleaved_lm_prefill(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    arms: dict[Hashable, Callable[[], AbstractContextManager]],
    warmup: int,
    repeats: int,
) -> dict[Hashable, Spread]:
    """The language-model prefill time of ``inputs`` under each arm (a function entering pruning, or
    nothing, for one prefill), timed as ``Bench`` times it: ``warmup`` untimed rounds, then ``repeats``
    timed rounds, every round over all arms in ``rotated`` order so that drift or another process
    cancels out of the comparison instead of favouring whichever ran first. For front ends that time a
    few configurations in one go (``priortr calibrate``, ``priortr demo``)."""
    names = list(arms)
    times: dict[Hashable, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + repeats):
        for name in rotated(names, round_):
            clock = [Clock(model.device)]
            with arms[name](), timing_hooks(model, clock), torch.inference_mode():
                model(**inputs, use_cache=True, logits_to_keep=1)
                if round_ >= warmup:
                    times[name].append(clock[0].elapsed_ms("lm_start", "lm_end"))
    return {name: Spread.of(samples) for name, samples in times.items()}


def run_bench(
    model: nn.Module,
    methods: Sequence[str],
    budgets: Sequence[int],
    batch_sizes: Sequence[int],
    progress: Callable[[Iterator], Iterator] = iter,
    **settings: Any,
) -> BenchReport:
    """Every (method, budget, batch) configuration, interleaved across repeats (``schedule``); with a
    ``journal``, each measurement is recorded as it finishes and those recorded are not repeated.
    ``settings`` are ``Bench``'s (layer, options, text_tokens, new_tokens, warmup, repeats, ...)."""
    bench = Bench(model, methods, budgets, batch_sizes, **settings)
    bench.run(progress)
    return bench.report()


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
        "attn_implementation": compat.masks.implementation(model),
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
        "| method | K | batch | LM prefill ms (median [q25, q75]) | ViT+proj ms | stage ms "
        "| KV MiB | samples/s | tokens/s | speed-up | roofline limit | of limit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in report.cases:
        overhead = "-"
        if c.overhead_ms:
            noisy = c.overhead_ms.width > c.overhead_ms.median
            overhead = f"{c.overhead_ms.median:.3f}{' (!)' if noisy else ''}"
        lines.append(
            f"| {c.method} | {c.budget if c.budget is not None else 'all'} | {c.batch} "
            f"| {c.lm_prefill_ms} | {c.vision_ms.median:.2f} | {overhead} "
            f"| {c.kv_cache_bytes / 2**20:.1f} | {c.samples_per_s:.2f} | {c.tokens_per_s:.1f} "
            f"| {c.speedup:.2f}x{'' if c.resolved else ' (!)'} | {c.limit_speedup:.2f}x "
            f"| {c.limit_ratio:.0%} |"
        )
    lines += ["", *COLUMNS]
    lines += [f"\nwarning: {line}" for line in spread_warnings(report)]
    return "\n".join(lines) + "\n"


COLUMNS = (
    "columns: LM prefill ms = the language model's forward in one prefill (embedding lookup to final norm:",
    "  every decoder layer and, for pruned rows, every stage); ViT+proj ms = vision tower to projector;",
    "  stage ms = all of the pruning stages' own work inside the LM prefill (evidence, decision, cut, cache",
    "  compaction, the kept tokens' RoPE and mask), marked by the engine around each stage, summed over",
    "  stages (- : no stage); KV MiB = the cache a prefill leaves; samples/s, tokens/s = end-to-end greedy",
    "  generate(); speed-up = vanilla's LM prefill median / this one's; roofline limit = the same ratio",
    "  predicted from FLOPs and bytes.",
    "  (!) = within noise: a speed-up whose medians differ by less than the timings' spread, or a stage",
    "  cost whose interquartile range is wider than its median.",
)
"""What each column of ``format_markdown``'s table brackets, printed under it."""


def spread_warnings(report: BenchReport) -> list[str]:
    """One line per speed-up (marked (!) in the table) whose prefill medians differ by less than the
    spread of the timings: the speed-up is within noise there."""
    return [
        f"{c.method} K={c.budget} batch {c.batch}: the LM prefill medians differ by less than the spread "
        f"of the timings ({c.lm_prefill_ms.width:.2f} ms); the speed-up {c.speedup:.2f}x is not resolved: "
        "add --repeats or free the machine"
        for c in report.cases
        if not c.resolved
    ]


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
