"""The pure parts of ``benchmarks/vllm_bench_serve.py`` (no server is started): reading /metrics, the
KV limit, each family's N and cache, the benchmark's and the servers' arguments as vLLM's own parsers
read them, and the targets' verdicts."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from vllm.benchmarks.serve import add_cli_args
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from benchmarks import qwen3_vl_layout
from benchmarks import vllm_bench_serve as bench
from benchmarks.vllm_bench_serve import FAMILIES, Cell, Family, Row
from priortr.adapters.qwen3_vl import deepstack_layers
from priortr.engine.config import check_injection
from priortr.integrations.vllm.settings import engine_config

LLAVA, QWEN3_VL = FAMILIES["llava-1.5"], FAMILIES["qwen3-vl"]

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


def test_qwen3_vl_n_and_cache_by_hand():
    """Qwen3-VL: 16-px patches merged 2 x 2, so a 768 x 768 image is (768 / 32)^2 = 24 x 24 = 576 visual
    tokens; its prompt 4 template + 40 text + 576 = 620 tokens, 652 with the answer: 21 blocks of 32
    (20.4), K = 64 keeps 44 + 64 + 32 = 140 (5 blocks, 4.4); 8 stock requests are 168 blocks and
    vLLM's null block 169, the LLaVA run's cache."""
    assert (QWEN3_VL.image_size, QWEN3_VL.image_tokens, QWEN3_VL.template_tokens) == (768, 576, 4)
    stock = QWEN3_VL.template_tokens + bench.TEXT_TOKENS + QWEN3_VL.image_tokens + bench.ANSWER_TOKENS
    assert stock == 652
    assert bench.kv_blocks(stock, bench.BLOCK_SIZE) == 21
    assert bench.kv_blocks(44 + 64 + 32, bench.BLOCK_SIZE) == 5
    assert bench.cache_blocks(QWEN3_VL, 8) == 169
    assert bench.cache_blocks(LLAVA, 8) == 169  # what docs/benchmarks.md's LLaVA run used
    assert bench.token_limit(44, 576, 64, 32) == pytest.approx(652 / 140)


def test_qwen3_vl_processor_makes_the_table_s_n_and_template_count():
    """The layout's own processor and chat template, on one random-mm-sized image and 40 words: N image
    pads, and template_tokens tokens besides the words and pads (the image before the question)."""
    processor = qwen3_vl_layout.qwen3_vl_processor()
    words = " ".join(["what"] * bench.TEXT_TOKENS)
    messages = [{"role": "user", "content": [{"type": "text", "text": words}, {"type": "image"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    side = QWEN3_VL.image_size
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8))
    ids = processor(text=[prompt], images=[picture], return_tensors="pt")["input_ids"][0].tolist()
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(pad) == QWEN3_VL.image_tokens
    assert len(ids) - ids.count(pad) - bench.TEXT_TOKENS == QWEN3_VL.template_tokens
    last_pad = len(ids) - 1 - ids[::-1].index(pad)
    assert ids[last_pad + 2 : last_pad + 2 + bench.TEXT_TOKENS] == ids[-1 - bench.TEXT_TOKENS : -1]


def test_qwen3_vl_layer_is_the_first_the_plug_in_allows():
    """The plug-in refuses a scored layer before the last DeepStack injection (layer J - 1): the
    family's layer passes the check the engine runs at start; one layer earlier is refused."""
    config = qwen3_vl_layout.qwen3_vl_config(hidden=512, layers=8)
    injected = deepstack_layers(config.vision_config, 8)
    assert injected == qwen3_vl_layout.DEEPSTACK_LEVELS == 3
    settings = {"method": "priortr", "budget": 64, "layer": QWEN3_VL.layer}
    check_injection(engine_config(settings, 8), injected, 8)
    with pytest.raises(ValueError, match="DeepStack"):
        check_injection(engine_config({**settings, "layer": QWEN3_VL.layer - 1}, 8), injected, 8)


def test_bench_arguments_are_vllms():
    """vLLM's own parser reads every argument the script passes, to the values meant."""
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        bench.bench_argv("http://127.0.0.1:1", "/m", LLAVA, 128, 16, 32, 7, Path("/r/cell.json"))
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
    stock = parser.parse_args(bench.bench_argv("http://x", "/m", LLAVA, None, 1, 4, 0, Path("/r/s.json")))
    assert stock.extra_body is None
    qwen = parser.parse_args(bench.bench_argv("http://x", "/m", QWEN3_VL, 64, 4, 8, 1, Path("/r/q.json")))
    assert qwen.random_mm_bucket_config == {(768, 768, 1): 1.0}
    assert qwen.extra_body == {"mm_processor_kwargs": {"priortr": {"budget": 64}}}


def run_args(family: Family, tp: int = 1, methods: tuple[str, ...] = ()) -> Namespace:
    """The benchmark's command line as ``main`` holds it after parsing (at ``--layer`` 2)."""
    return Namespace(
        family=family, layer=2, budgets=list(bench.BUDGETS), methods=list(methods), tensor_parallel_size=tp
    )


@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES)
def test_server_arguments_are_vllms(family):
    """vLLM's server parser reads every server's arguments: the same cache and block size for stock
    and priortr, the priortr settings only on priortr's, the family's flags on both."""
    parser = make_arg_parser(FlexibleArgumentParser())
    blocks = bench.cache_blocks(family, 8)
    stock, pruned = (
        parser.parse_args(
            bench.server_argv(server, run_args(family), Path("/m"), Path("/t.jinja"), blocks, 8000)
        )
        for server in (bench.STOCK, bench.PRIORTR)
    )
    for args in (stock, pruned):
        assert (args.num_gpu_blocks_override, args.block_size, args.max_model_len) == (169, 32, 1024)
        assert (args.model, args.chat_template, args.port) == ("/m", "/t.jinja", 8000)
        assert args.tensor_parallel_size == 1
    assert stock.hf_overrides in (None, {})
    assert pruned.hf_overrides == {
        "priortr": {"method": "priortr", "budget": 64, "layer": 2, "request_budgets": [192, 128, 64]}
    }
    assert (stock.trust_request_mm_kwargs, pruned.trust_request_mm_kwargs) == (False, True)
    limits = None if family is LLAVA else {"image": 1, "video": 0}
    assert stock.limit_mm_per_prompt == pruned.limit_mm_per_prompt
    assert (stock.limit_mm_per_prompt or None) == limits


def test_method_servers_serve_the_engines_budget_alone():
    """A ``--methods`` server starts with its method at K = 64 (its own layers; ``stages`` at
    ``--layer`` and two deeper) and grants requests nothing; ``--tensor-parallel-size`` reaches every
    server; the plan puts the method servers beside stock and priortr, each warmed up without a budget."""
    parser = make_arg_parser(FlexibleArgumentParser())
    args = run_args(LLAVA, tp=2, methods=("clse", "visionzip", "stages"))
    read = {
        method: parser.parse_args(
            bench.server_argv(bench.method_server(method), args, Path("/m"), Path("/t"), 169, 8000)
        )
        for method in args.methods
    }
    assert read["clse"].hf_overrides == {"priortr": {"method": "clse", "budget": 64}}
    assert read["visionzip"].hf_overrides == {"priortr": {"method": "visionzip", "budget": 64}}
    assert read["stages"].hf_overrides == {"priortr": {"method": "priortr", "stages": [[2, 128], [4, 64]]}}
    assert all(not r.trust_request_mm_kwargs and r.tensor_parallel_size == 2 for r in read.values())
    plan = bench.phases(defaults_off=False, budgets=(64,), methods=("clse",))
    assert [s.name for s in plan[0].settings] == ["stock", "K=64", "clse K=64"]
    assert bench.warmup_budgets(plan, bench.method_server("clse")) == [None]


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
    rows |= {
        ("clse K=64", 1): Row.of([cell("clse K=64", 1, 0.9, 70, 1)], holds=36.0),
        ("clse K=64", 64): Row.of([cell("clse K=64", 64, 3.0, 600, 36)], holds=36.0),
    }
    lines = bench.targets(rows, ["stock", "K=128", "K=64", "clse K=64"])
    assert "- requests decoding at once at C=64, stock: 1.00 of the limit: met" in lines
    assert "- requests decoding at once at C=64, K=128: 0.80 of the limit: MISSED" in lines
    assert "- requests/s vs stock at every C, K=128: 1.50x, 0.95x: MISSED" in lines
    assert "- requests/s vs stock at every C, K=64: 1.60x, 2.00x: met" in lines
    assert "- TTFT p99 at C=64, K=128: 950 ms vs stock 900 ms: MISSED" in lines
    assert "- TTFT p99 at C=64, K=64: 500 ms vs stock 900 ms: met" in lines
    assert "- requests/s vs stock at every C, clse K=64: 0.90x, 1.50x: MISSED" in lines


def test_warmup_covers_every_budget_a_server_is_asked_for():
    """Stock warms up without a budget, priortr's server at each of K = 192 / 128 / 64 (its cells' order),
    each server with a default off at K = 64 alone."""
    plan = bench.phases()
    assert bench.warmup_budgets(plan, bench.STOCK) == [None]
    assert bench.warmup_budgets(plan, bench.PRIORTR) == [192, 128, 64]
    assert [bench.warmup_budgets(plan, off) for off in bench.DEFAULTS_OFF] == [[64]] * 3
    assert bench.warmup_budgets(bench.phases(defaults_off=False), bench.DEFAULTS_OFF[0]) == []


def test_moe_layout_routes_as_qwen3_vl_30b_a3b():
    """The MoE layout: Qwen3-VL's text model with a sparse MoE block in every decoder layer, top-8
    routing and experts 768 / 2048 of the width wide, as Qwen3-VL-30B-A3B; the dense layout has none."""
    text = qwen3_vl_layout.qwen3_vl_config(hidden=512, layers=8, moe=True).text_config
    assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (32, 8, 192)
    assert (text.decoder_sparse_step, text.mlp_only_layers) == (1, [])
    assert not hasattr(qwen3_vl_layout.qwen3_vl_config(hidden=512, layers=8).text_config, "num_experts")
    assert FAMILIES["qwen3-vl-moe"].layer == QWEN3_VL.layer
