"""A serving soak (issue 39, item 7; a benchmark, not a CI test): mixed traffic through vLLM's
OpenAI server with the plug-in for ``--minutes``, then every completed answer checked against the
same request sent alone.

    PYTHONPATH=$PWD/src .venv-vllm/bin/python benchmarks/vllm_soak.py [--minutes 10] [--clients 8]
        [--max-requests 20000] [--tokens 12] [--abort-share 0.1] [--out benchmarks/results/vllm-soak]

The model is the tests' tiny random-weight Qwen2-VL (``tests/vllm/checkpoints.py``: head_dim 32,
float32, a 112x112 image is 16 visual tokens), built offline into a temporary folder. The server is
``tests/vllm/test_http.py``'s ``serving`` (``python -m vllm.entrypoints.openai.api_server`` on a
free port of 127.0.0.1, the flags docs/serving.md documents, priortr through ``--hf-overrides``,
its log in ``--out``/serve.log), with up to two images per prompt.

``--clients`` threads send greedy chat completions (temperature 0, ``--tokens`` tokens, EOS
ignored) until the time or the request count runs out. Each request draws: text only, one image or
two (from four small images, so the same image comes back at different kept counts); the engine's
budget, a count, a ratio, or pruning off (``mm_processor_kwargs``); one of two questions; streaming
or not; and, for a share ``--abort-share`` of the streaming ones, the connection closed after the
first tokens (an abort). Then:

* every distinct completed request is sent again alone (sequentially): each answer of the load must
  be the text of that request alone (streamed answers are joined from their deltas);
* the RSS of the server and of its engine processes (psutil), after a warm-up and at the end, and
  their total every ``--rss-every`` seconds of the load (the trajectory: caches filling level off,
  a leak keeps rising);
* vLLM's KV-cache usage from ``/metrics`` once the server is idle, after the load and at the end:
  it must be 0 (aborted requests freed their blocks);
* the server log's ERROR and Traceback lines, and the engine's finished requests by reason
  (``vllm:request_success_total``: length, abort, error); the requests sent that the engine did not
  finish are those a closed connection aborted (vLLM 0.32 counts none of them under "abort");
* a control that the comparison can fail: some pruned request's answer alone must differ from the
  same images and question with pruning off.

Writes ``soak.json`` and ``soak.md`` into ``--out``; exits 1 if a request failed, an answer differs,
the KV cache is not empty when idle, the log has an error, the engine finished a request by an
error, the control finds no answer changed by pruning, or the RSS grew by more than
``--max-rss-growth`` (a fraction) over the load's second half: the first seconds of load fill
vLLM's and the allocator's caches (about +3% of RSS in the 2-minute trial), so start to end is
reported, not checked.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the vLLM tests run the server (conftest.py)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if __package__ in (None, ""):  # run as a script: the tests' checkpoint and server helpers
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import vllm

from tests.vllm import checkpoints
from tests.vllm.reference import image
from tests.vllm.test_http import data_url, serving

SETTINGS = {"method": "priortr", "budget": 6, "layer": 1, "request_budgets": [3, 10, 0.5]}
BUDGETS: dict[str, dict | None] = {
    "engine K=6": None,
    "K=3": {"budget": 3},
    "K=10": {"budget": 10},
    "ratio 0.5": {"budget": 0.5},
    "pruning off": {"enabled": False},
}
PICTURES = [image(112, seed) for seed in (40, 41, 42, 43)]
IMAGE_SETS = [(), (0,), (1,), (2,), (3,), (0, 1), (2, 3), (1, 1)]  # (1, 1): one image twice
QUESTIONS = ["what is in the image", "describe the picture"]
ABORT_AFTER_CHUNKS = 2
REQUEST_TIMEOUT_S = 300
IDLE_TIMEOUT_S = 120


@dataclass(frozen=True)
class Request:
    """What decides a greedy answer: the images (indices into PICTURES), the budget, the question."""

    images: tuple[int, ...]
    budget: str
    question: int

    @property
    def kind(self) -> str:
        shown = {0: "text only", 1: "one image", 2: "two images"}[len(self.images)]
        return shown if not self.images else f"{shown}, {self.budget}"


@dataclass
class Outcome:
    """One request of the load: how it was sent, how it ended, and its text if it completed."""

    request: Request
    stream: bool
    abort: bool
    status: str  # "completed", "aborted" or "failed"
    text: str = ""
    error: str = ""


def body(model: str, request: Request, tokens: int, stream: bool) -> dict:
    """The chat-completion JSON of ``request``: its images as PNG data URLs, then the question; its
    budget in ``mm_processor_kwargs`` unless it takes the engine's (or has no image to prune)."""
    content: list[dict] = [
        {"type": "image_url", "image_url": {"url": data_url(PICTURES[i])}} for i in request.images
    ]
    content.append({"type": "text", "text": QUESTIONS[request.question]})
    out: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    budget = BUDGETS[request.budget] if request.images else None  # text only: nothing to prune
    if budget is not None:
        out["mm_processor_kwargs"] = {"priortr": budget}
    return out


def send(url: str, model: str, request: Request, tokens: int, stream: bool, abort: bool) -> Outcome:
    """One chat completion; ``abort``: close the streamed connection after ABORT_AFTER_CHUNKS chunks."""
    data = json.dumps(body(model, request, tokens, stream)).encode()
    http = urllib.request.Request(f"{url}/v1/chat/completions", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(http, timeout=REQUEST_TIMEOUT_S) as reply:
            if not stream:
                answer = json.load(reply)
                choice = answer["choices"][0]
                if choice["finish_reason"] != "length":
                    return Outcome(request, stream, abort, "failed", error=f"finished by {choice}")
                return Outcome(request, stream, abort, "completed", choice["message"]["content"])
            text, chunks, finish = [], 0, None
            for line in reply:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                text.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
                chunks += 1
                if abort and chunks >= ABORT_AFTER_CHUNKS:
                    return Outcome(request, stream, abort, "aborted")  # `with` closes the socket
            if finish != "length":
                return Outcome(request, stream, abort, "failed", error=f"stream finished by {finish}")
            return Outcome(request, stream, abort, "completed", "".join(text))
    except (OSError, ValueError, KeyError) as error:
        detail = error.read().decode()[:300] if isinstance(error, urllib.error.HTTPError) else ""
        return Outcome(request, stream, abort, "failed", error=f"{error!r} {detail}".strip())


def load(url: str, model: str, args: argparse.Namespace) -> list[Outcome]:
    """``args.clients`` threads of random requests until ``args.minutes`` or ``args.max_requests``."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    deadline = time.monotonic() + args.minutes * 60

    def client(seed: int) -> None:
        draw = random.Random(seed)
        while time.monotonic() < deadline:
            with lock:
                if len(outcomes) >= args.max_requests:
                    return
            images = draw.choice(IMAGE_SETS)
            request = Request(images, draw.choice(list(BUDGETS)) if images else "", draw.randrange(2))
            stream = draw.random() < 0.5
            abort = stream and draw.random() < 2 * args.abort_share
            outcome = send(url, model, request, args.tokens, stream, abort)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def metric(url: str, name: str, label: str = "") -> float:
    """The sum of one gauge or counter of the server's Prometheus ``/metrics`` over its label sets
    (those holding ``label``, e.g. ``finished_reason="abort"``, when given)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", re.MULTILINE)
    found = pattern.findall(text)
    if not found:
        raise SystemExit(f"{name} is not in {url}/metrics; this vLLM names its metrics differently")
    return sum(float(value) for labels, value in found if label in labels)


def idle_kv_usage(url: str) -> float:
    """KV-cache usage once no request runs or waits (bounded wait), as a fraction of the cache."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        busy = metric(url, "vllm:num_requests_running") + metric(url, "vllm:num_requests_waiting")
        if busy == 0:
            break
        time.sleep(1)
    time.sleep(2)  # the engine publishes its stats once a step; let the last step's reach /metrics
    return metric(url, "vllm:kv_cache_usage_perc")


def server_rss() -> dict[str, float]:
    """RSS in MiB of the API server (this script's child) and of each process under it (the engine)."""
    (server,) = [
        child
        for child in psutil.Process().children()
        if "vllm.entrypoints.openai.api_server" in " ".join(child.cmdline())
    ]
    out = {"api server": server.memory_info().rss / 2**20}
    for child in server.children(recursive=True):
        out[f"{child.name()} ({child.pid})"] = child.memory_info().rss / 2**20
    out["total"] = sum(out.values())
    return {name: round(value, 1) for name, value in out.items()}


def changed_by_pruning(alone: dict[Request, Outcome]) -> list[Request]:
    """The pruned image requests whose answer alone differs from the same images and question with
    pruning off: if none did, equal answers would not show that the kept tokens were the same."""
    off = {(r.images, r.question): o.text for r, o in alone.items() if r.budget == "pruning off"}
    return [
        r
        for r, o in alone.items()
        if r.images and r.budget != "pruning off" and off.get((r.images, r.question), o.text) != o.text
    ]


def sample_rss(samples: list, stop: threading.Event, began: float, every: float) -> None:
    """Append (seconds into the load, ``server_rss()``) every ``every`` seconds until ``stop``."""
    while not stop.wait(every):
        samples.append((round(time.perf_counter() - began, 1), server_rss()))


def log_errors(log: Path) -> list[str]:
    return [
        line for line in log.read_text(errors="replace").splitlines() if re.search(r"ERROR|Traceback", line)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    parser.add_argument("--clients", type=int, default=8, help="concurrent client threads")
    parser.add_argument("--max-requests", type=int, default=20000, help="bound on the load's requests")
    parser.add_argument("--tokens", type=int, default=12, help="max_tokens of every request")
    parser.add_argument("--abort-share", type=float, default=0.1, help="share of requests aborted")
    parser.add_argument(
        "--max-rss-growth",
        type=float,
        default=0.03,
        help="allowed RSS growth over the load's second half, a fraction (the first half fills caches)",
    )
    parser.add_argument("--rss-every", type=float, default=30.0, help="seconds between RSS samples")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm-soak"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    limits = '--limit-mm-per-prompt={"image": 2, "video": 0}'
    with tempfile.TemporaryDirectory() as folder:
        model = str(checkpoints.qwen2_vl(Path(folder)))
        with serving(Path(model), args.out, SETTINGS, limits) as url:
            warm_up = [Request((), "", 0), Request((0,), "K=3", 0), Request((0, 1), "pruning off", 1)]
            for request in warm_up:
                for stream in (False, True):
                    outcome = send(url, model, request, args.tokens, stream, abort=False)
                    if outcome.status != "completed":
                        raise SystemExit(f"warm-up request {request} failed: {outcome.error}")
            rss_start = server_rss()
            print(f"warm: RSS {rss_start}; load of {args.minutes} min by {args.clients} clients", flush=True)
            load_began = time.perf_counter()
            samples, stop = [], threading.Event()
            sampler = threading.Thread(target=sample_rss, args=(samples, stop, load_began, args.rss_every))
            sampler.start()
            outcomes = load(url, model, args)
            load_seconds = time.perf_counter() - load_began
            stop.set()
            sampler.join()
            kv_after_load = idle_kv_usage(url)
            rss_after_load = server_rss()
            print(f"load done: {len(outcomes)} requests; KV usage idle {kv_after_load}", flush=True)
            completed = [o for o in outcomes if o.status == "completed"]
            alone = {}
            for request in sorted({o.request for o in completed}, key=repr):
                alone[request] = send(url, model, request, args.tokens, stream=False, abort=False)
            kv_end = idle_kv_usage(url)
            rss_end = server_rss()
            finished = {
                reason: metric(url, "vllm:request_success_total", f'finished_reason="{reason}"')
                for reason in ("length", "abort", "error")
            }
            errors = log_errors(args.out / "serve.log")  # before the server stops: vLLM's own teardown
            # (SIGTERM, abort with timeout 0) logs an EngineDeadError of its output handler
    mismatches = [
        {"request": asdict(o.request), "stream": o.stream, "load": o.text, "alone": alone[o.request].text}
        for o in completed
        if alone[o.request].status != "completed" or o.text != alone[o.request].text
    ]
    failed = [o for o in outcomes if o.status == "failed"] + [
        o for o in alone.values() if o.status == "failed"
    ]
    changed = len(changed_by_pruning(alone))
    growth = rss_end["total"] / rss_start["total"] - 1
    halfway = min(samples, key=lambda sample: abs(sample[0] - load_seconds / 2), default=(0, rss_start))
    steady_growth = rss_after_load["total"] / halfway[1]["total"] - 1
    checks = {
        "no request failed": not failed,
        "every completed answer equals the request alone": not mismatches,
        "KV-cache usage 0 when idle": kv_after_load == 0 and kv_end == 0,
        "no ERROR or Traceback in the server log": not errors,
        "no request finished by an engine error": finished["error"] == 0,
        "pruning changes answers (the comparison can fail)": changed > 0,
        f"RSS grew by at most {args.max_rss_growth:.0%} over the load's second half": steady_growth
        <= args.max_rss_growth,
    }
    status = Counter(o.status for o in outcomes)
    report = {
        "command": "python benchmarks/vllm_soak.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "versions": {"vllm": vllm.__version__, "python": platform.python_version()},
        "machine": {"cores": os.cpu_count(), "load_average_end": os.getloadavg()},
        "settings": SETTINGS,
        "wall_seconds": round(time.perf_counter() - began, 1),
        "load_seconds": round(load_seconds, 1),
        "requests": len(outcomes),
        "completed": status["completed"],
        "aborted": status["aborted"],
        "failed": status["failed"],
        "streamed": sum(o.stream for o in outcomes),
        "by_kind": {
            kind: dict(Counter(o.status for o in outcomes if o.request.kind == kind))
            for kind in sorted({o.request.kind for o in outcomes})
        },
        "distinct_requests_replayed": len(alone),
        "replayed_image_requests_differing_from_pruning_off": changed,
        "engine_finished_requests": finished,
        # Each request sent (warm-up, load, replays) that the engine did not finish: ended by an abort.
        "engine_unfinished_requests": 2 * len(warm_up) + len(outcomes) + len(alone) - sum(finished.values()),
        "mismatches": mismatches,
        "failures": [{"request": asdict(o.request), "stream": o.stream, "error": o.error} for o in failed],
        "rss_mib": {"start (after warm-up)": rss_start, "after load": rss_after_load, "end": rss_end},
        "rss_growth": round(growth, 4),
        "rss_growth_second_half_of_load": round(steady_growth, 4),
        "rss_mib_during_load": [{"seconds": at, **rss} for at, rss in samples],
        "kv_cache_usage_idle": {"after load": kv_after_load, "end": kv_end},
        "log_errors": errors,
        "checks": checks,
    }
    (args.out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "soak.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    sys.exit(0 if all(checks.values()) else 1)


def markdown(report: dict) -> str:
    rss = report["rss_mib"]
    lines = [
        f"{report['requests']} requests in {report['load_seconds']} s ({report['streamed']} streamed): "
        f"{report['completed']} completed, {report['aborted']} aborted, {report['failed']} failed; "
        f"{report['distinct_requests_replayed']} distinct completed requests sent again alone; "
        f"wall time {report['wall_seconds']} s",
        "",
        "| kind | completed | aborted | failed |",
        "| --- | --- | --- | --- |",
        *(
            f"| {kind} | {c.get('completed', 0)} | {c.get('aborted', 0)} | {c.get('failed', 0)} |"
            for kind, c in report["by_kind"].items()
        ),
        "",
        f"RSS (MiB, server + engine): {rss['start (after warm-up)']['total']} after warm-up, "
        f"{rss['after load']['total']} after the load, {rss['end']['total']} at the end "
        f"({report['rss_growth']:+.1%}; over the load's second half "
        f"{report['rss_growth_second_half_of_load']:+.1%}); "
        "during the load (s: MiB): "
        + ", ".join(f"{r['seconds']:.0f}: {r['total']}" for r in report["rss_mib_during_load"])
        + "; "
        f"KV-cache usage when idle: "
        f"{report['kv_cache_usage_idle']['after load']} after the load, "
        f"{report['kv_cache_usage_idle']['end']} at the end; "
        f"answers differing from the request alone: {len(report['mismatches'])}; "
        f"ERROR / Traceback lines in the server log: {len(report['log_errors'])}; "
        f"finished in the engine (vllm:request_success_total): {report['engine_finished_requests']}, "
        f"not finished (aborted): {report['engine_unfinished_requests']}; "
        f"pruned requests whose answer differs from pruning off: "
        f"{report['replayed_image_requests_differing_from_pruning_off']}",
        "",
        "| check | result |",
        "| --- | --- |",
        *(f"| {name} | {'pass' if ok else 'FAIL'} |" for name, ok in report["checks"].items()),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
