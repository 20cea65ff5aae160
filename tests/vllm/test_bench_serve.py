"""The pure parts of ``benchmarks/vllm_bench_serve.py`` (no server is started): reading /metrics, the
KV limit, the benchmark's arguments as vLLM's own parser reads them, and the targets' verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.benchmarks.serve import add_cli_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

from benchmarks import vllm_bench_serve as bench
from benchmarks.vllm_bench_serve import Cell, Row

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/tmp/x"} 3.0
vllm:num_requests_running{engine="1",model_name="/tmp/x"} 2.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="/tmp/x"} 7.0
vllm:num_preemptions_created{engine="0",model_name="/tmp/x"} 1.7e+09
vllm:kv_cache_usage_perc{engine="0",model_name="/tmp/x"} 0.25
"""


def test_parse_metrics_sums_label_sets_and_skips_other_names():
    names = ("vllm:num_requests_running", "vllm:num_preemptions_total", "vllm:kv_cache_usage_perc")
    assert bench.parse_metrics(METRICS, names) == {
        "vllm:num_requests_running": 5.0,
        "vllm:num_preemptions_total": 7.0,
        "vllm:kv_cache_usage_perc": 0.25,
    }


def test_parse_metrics_refuses_a_missing_name():
    with pytest.raises(SystemExit, match="vllm:prefix_cache_hits_total"):
        bench.parse_metrics(METRICS, ("vllm:num_requests_running", "vllm:prefix_cache_hits_total"))


def test_kv_limit_by_hand():
    # LLaVA-1.5: 44 text tokens, 576 visual, 32 answer tokens; K = 64 keeps 44 + 64 + 32 = 140 tokens.
    assert bench.kv_blocks(44 + 576 + 32, 16) == 41  # 652 / 16 = 40.75
    assert bench.kv_blocks(44 + 64 + 32, 16) == 9  # 140 / 16 = 8.75
    assert bench.kv_blocks(32, 16) == 2
    assert bench.token_limit(44, 576, 64, 32) == pytest.approx(652 / 140)
    assert bench.token_limit(44, 576, 576, 32) == 1.0


def test_bench_arguments_are_vllms():
    """vLLM's own parser reads every argument the script passes, to the values meant."""
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        bench.bench_argv("http://127.0.0.1:1", "/m", 128, 16, 32, 7, Path("/r/cell.json"))
    )
    assert (args.backend, args.dataset_name, args.endpoint) == (
        "openai-chat",
        "random-mm",
        "/v1/chat/completions",
    )
    assert (args.max_concurrency, args.num_prompts, args.seed) == (16, 32, 7)
    assert (args.random_input_len, args.random_output_len) == (bench.TEXT_TOKENS, bench.ANSWER_TOKENS)
    assert args.random_mm_bucket_config == {(336, 336, 1): 1.0}
    assert args.random_mm_limit_mm_per_prompt == {"image": 1, "video": 0}
    assert args.extra_body == {"mm_processor_kwargs": {"priortr": {"budget": 128}}}
    assert (args.ignore_eos, args.temperature, args.save_result) == (True, 0.0, True)
    assert (args.result_dir, args.result_filename) == ("/r", "cell.json")
    stock = parser.parse_args(bench.bench_argv("http://x", "/m", None, 1, 4, 0, Path("/r/s.json")))
    assert stock.extra_body is None


def test_decoding_at_once_by_hand():
    """Decoding intervals [start + TTFT, start + latency]: [1, 5], [2, 3], [3, 6], [5.5, 7]: at most
    two at once (the second ends at 3 as the third starts; the first ends at 5 before the fourth)."""
    starts, ttfts, latencies = [0, 0, 1, 4], [1, 2, 2, 1.5], [5, 3, 5, 3]
    assert bench.decoding_at_once(starts, ttfts, latencies) == 2
    assert bench.decoding_at_once([0, 0], [1, 1], [4, 4]) == 2
    assert bench.decoding_at_once([], [], []) == 0


def cell(setting: str, concurrency: int, rps: float, ttft_p99: float, running: int) -> Cell:
    keys = dict.fromkeys(bench.BENCH_KEYS, 0.0)
    result = {**keys, "request_throughput": rps, "p99_ttft_ms": ttft_p99, "completed": 1}
    return Cell(
        setting=setting,
        phase=0,
        concurrency=concurrency,
        round=0,
        prompts=4,
        seed=0,
        bench=result,
        peak_running=64,
        peak_decoding=running,
        mean_decoding=running / 2,
        peak_kv_usage=0.5,
        preemptions=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )


def test_targets_met_and_missed():
    """K=128 beats stock at C=1 and loses at C=64 (missed); K=64 beats it at both (met); held / limit
    and TTFT p99 judged at the highest concurrency."""
    rows = {
        ("stock", 1): Row.of([cell("stock", 1, 1.0, 100, 1)], holds=8.0),
        ("stock", 64): Row.of([cell("stock", 64, 2.0, 900, 8)], holds=8.0),
        ("K=128", 1): Row.of([cell("K=128", 1, 1.5, 80, 1)], holds=25.0),
        ("K=128", 64): Row.of([cell("K=128", 64, 1.9, 950, 20)], holds=25.0),
        ("K=64", 1): Row.of([cell("K=64", 1, 1.6, 70, 1)], holds=36.0),
        ("K=64", 64): Row.of([cell("K=64", 64, 4.0, 500, 36)], holds=36.0),
    }
    lines = bench.targets(rows, ["stock", "K=128", "K=64"])
    assert "- requests decoding at once at C=64, stock: 1.00 of the limit: met" in lines
    assert "- requests decoding at once at C=64, K=128: 0.80 of the limit: MISSED" in lines
    assert "- requests/s vs stock at every C, K=128: 1.50x, 0.95x: MISSED" in lines
    assert "- requests/s vs stock at every C, K=64: 1.60x, 2.00x: met" in lines
    assert "- TTFT p99 at C=64, K=128: 950 ms vs stock 900 ms: MISSED" in lines
    assert "- TTFT p99 at C=64, K=64: 500 ms vs stock 900 ms: met" in lines
