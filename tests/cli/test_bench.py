"""``priortr bench`` on a reduced LLaVA shape: exact KV bytes, FLOPs and roofline, complete reports.

Timings are never asserted (they flake when cores are shared); the numbers belong in
docs/benchmarks.md. The statistics, the interleaved schedule and resuming are tested on hand-made
timings in test_bench_stats.py.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

from priortr.cli import main
from priortr.tools import bench, flops

TEXT, N_VISUAL, K = 48, 576, 64


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """A LLaVA-1.5-shaped config (576 visual tokens from a 336 px image) with a small LLM."""
    text = LlamaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    vision = CLIPVisionConfig(
        image_size=336,
        patch_size=14,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    config = LlavaConfig(
        text_config=text, vision_config=vision, image_token_id=999, image_seq_length=N_VISUAL
    )
    path = tmp_path_factory.mktemp("llava-reduced")
    config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def report(config_dir):
    model = bench.build_model(str(config_dir), torch.device("cpu"), torch.float32)
    return bench.run_bench(
        model,
        ["vanilla", "priortr", "fastv", "pdrop", "visionzip", "sparsevlm", "clse", "downsample"],
        [K],
        [1],
        layer=2,
        text_tokens=TEXT,
        new_tokens=2,
        warmup=1,
        repeats=3,
        decode_repeats=1,
    )


def test_kv_cache_bytes_are_measured_and_exact(report):
    vanilla, *pruned = report.cases
    assert vanilla.kv_cache_bytes == vanilla.kv_cache_expected_bytes
    for case in pruned:
        assert case.kv_cache_bytes == case.kv_cache_expected_bytes
        # SparseVLM's published schedule, scaled to 8 layers, ends with 17 tokens for K = 64, and the
        # authors' code recycles one cluster on top of them; VisionZip's [CLS] takes one of its K slots;
        # CLSE's "64" keeps 110, 70, then 20; downsample pools the 24 x 24 grid to 8 x 8 = 64.
        kept = {"sparsevlm": 18, "visionzip": K - 1, "clse": 20}.get(case.method, K)
        assert case.kv_cache_bytes * (TEXT + N_VISUAL) == vanilla.kv_cache_bytes * (TEXT + kept)


def test_pruning_lowers_the_prefill_flops_and_the_roofline_allows_a_speed_up(report, config_dir):
    """What the bench computes from shapes, not clocks (a timing assertion flakes on shared cores): at
    11% of the visual tokens every method's language-model prefill FLOPs fall below vanilla's, its
    roofline limit is above 1 and at most every layer on 112 tokens instead of 624, and the reported
    speed-up is the ratio of the measured medians."""
    vanilla = report.cases[0]
    full = vanilla.lm_flops
    config = str(config_dir / "config.json")
    for case in report.cases[1:]:
        kept = K - 1 if case.method == "visionzip" else K  # VisionZip's [CLS] takes one of its K slots
        everything_pruned = full / flops.scheduled_prefill_flops(
            config, TEXT, N_VISUAL, [(-1, kept)], exact=True
        )
        assert case.lm_flops < full, case
        assert 1.0 < case.limit_speedup <= everything_pruned + 1e-9
        assert case.speedup == pytest.approx(vanilla.lm_prefill_ms.median / case.lm_prefill_ms.median)
        assert case.overhead_ms is not None and case.overhead_ms.runs == 3


def test_reports_are_complete(report, tmp_path):
    table = bench.format_markdown(report)
    assert table.count("\n| ") == 2 + len(report.cases)  # header, rule, one row per case
    assert "roofline limit" in table
    document = report.to_json()
    methods = {"vanilla", "priortr", "fastv", "pdrop", "visionzip", "sparsevlm", "clse", "downsample"}
    assert {row["method"] for row in document["cases"]} == methods
    assert document["ceilings"]["matmul_flops_per_s"] > 0 and document["meta"]["device_type"] == "cpu"
    bench.plot(report, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 5_000


def bench_argv(config_dir, out) -> list[str]:
    """A one-case ``priortr bench`` (vanilla and PriorTR at K = 64, batch 1) on 4 layers."""
    return [
        "bench",
        "--model",
        str(config_dir),
        "--layers",
        "4",
        "--methods",
        "vanilla",
        "priortr",
        "--budgets",
        "64",
        "--batch-sizes",
        "1",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--decode-repeats",
        "1",
        "--new-tokens",
        "1",
        "--json",
        "--out",
        str(out),
    ]


def test_bench_command_prints_one_json_document(config_dir, tmp_path, capsys):
    argv = bench_argv(config_dir, tmp_path)
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert [row["method"] for row in document["cases"]] == ["vanilla", "priortr"]
    assert document["meta"]["text_layers"] == 4
    assert {p.name for p in tmp_path.iterdir()} == {"bench.jsonl", "bench.json", "bench.md", "bench.png"}


def test_bench_without_matplotlib_keeps_every_number_and_says_why_no_plot(
    config_dir, tmp_path, capsys, monkeypatch
):
    """The accelerator image may lack matplotlib (scripts/gpu-check.sh runs bench there): the run ends
    well, with bench.json and bench.md, and says why bench.png is missing."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails, as if not installed
    assert main(bench_argv(config_dir, tmp_path)) == 0
    captured = capsys.readouterr()
    assert [row["method"] for row in json.loads(captured.out)["cases"]] == ["vanilla", "priortr"]
    assert {p.name for p in tmp_path.iterdir()} == {"bench.jsonl", "bench.json", "bench.md"}
    assert "bench.png not drawn: matplotlib is not installed" in captured.err
