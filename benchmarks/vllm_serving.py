"""Stock vLLM against vLLM with priortr (docs/serving.md): KV blocks per request, the largest number of
requests running at once in a fixed KV cache, and throughput, at K = 192 / 128 / 64.

    .venv-vllm/bin/python benchmarks/vllm_serving.py [--layers 8] [--hidden 1024] [--requests 12]
        [--tokens 32] [--cache-requests 2] [--rounds 5] [--out benchmarks/results/vllm-cpu]

The model is LLaVA-1.5-7B's layout with random weights, built offline into a temporary checkpoint:
a CLIP grid of 336 / 14 = 24 x 24 = 576 visual tokens per image (a 2-layer, 64-wide tower, since the
encoder's cost is the same with and without pruning), LLaVA-1.5-7B's head size (128), vocabulary
(32064) and MLP ratio, at a narrower width and depth (``--hidden``, ``--layers``) so that a run fits
a small CPU. Two engines run in this process: stock (no ``priortr`` settings) and pruned (PriorTR
at ``--layer``; each request's K rides in ``mm_processor_kwargs``), with the same fixed KV cache: room
for ``--cache-requests`` stock requests (prompt and output). Per setting:

* prompt tokens and KV blocks of one request alone (blocks read from vLLM's KV-cache usage at its
  last step), and how many such requests the cache holds to the end of their output;
* a batch of ``--requests`` requests submitted at once (distinct images, every answer exactly
  ``--tokens`` tokens): the most requests vLLM ran at once, its preemptions, requests/s and output
  tokens/s. Settings alternate within each of ``--rounds`` rounds, so load from other processes
  falls on all of them; the median over rounds is reported, with the spread.

Writes ``vllm.json`` and ``vllm.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # both engines in this process
os.environ.setdefault("OMP_NUM_THREADS", "1")  # vLLM's own default for serving on a CPU
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import transformers
import vllm
from PIL import Image
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)
from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.v1.metrics.loggers import StatLoggerBase

IMAGE_SIZE, PATCH = 336, 14  # LLaVA-1.5's CLIP ViT-L/14-336: 576 visual tokens
VOCAB, IMAGE_ID, PAD_ID = 32064, 32000, 32001
SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2, "\n": 3, "USER:": 4, "ASSISTANT:": 5, "<image>": IMAGE_ID}
STOCK = "stock"


def build_checkpoint(path: Path, hidden: int, layers: int, seed: int) -> Path:
    """Write a random-weight LLaVA-1.5 layout (see the module docstring) and its processor to ``path``."""
    text = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=round(hidden * 11008 / 4096 / 64) * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = CLIPVisionConfig(
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=64,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE_ID,
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration._from_config(config, dtype=torch.float32).save_pretrained(path)
    _name_tower_as_llava_hf(path / "model.safetensors")
    fixed = {**SPECIALS, "<pad>": PAD_ID}
    taken = set(fixed.values())
    vocab = fixed | {f"w{i}": i for i in range(VOCAB) if i not in taken}
    backend = Tokenizer(models.WordLevel(vocab, "<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )
    tokenizer.add_tokens(["\n"])
    LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
        ),
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    ).save_pretrained(path)
    return path


def _name_tower_as_llava_hf(file: Path) -> None:
    """Name the CLIP tower's weights as the llava-hf checkpoints do (``vision_tower.vision_model.*``),
    which vLLM's loader expects (transformers reads both)."""
    tower, nested = "vision_tower.", "vision_tower.vision_model."
    weights = {
        nested + name.removeprefix(tower)
        if name.startswith(tower) and not name.startswith(nested)
        else name: value
        for name, value in load_file(file).items()
    }
    save_file(weights, file, metadata={"format": "pt"})


class PeakStats(StatLoggerBase):
    """The most requests running at once, the highest KV-cache usage and the preemptions since
    ``reset``, from vLLM's per-step scheduler and iteration stats."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.reset()

    def reset(self) -> None:
        self.running = 0
        self.usage = 0.0
        self.preempted = 0

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ):
        if scheduler_stats is not None:
            self.running = max(self.running, scheduler_stats.num_running_reqs)
            self.usage = max(self.usage, scheduler_stats.kv_cache_usage)
        if iteration_stats is not None:
            self.preempted += iteration_stats.num_preempted_reqs

    def log_engine_initialized(self) -> None:
        pass


@dataclass
class Engine:
    """One vLLM engine of the run and the stats logger attached to it."""

    engine: LLMEngine
    stats: PeakStats


def start_engine(path: Path, args: argparse.Namespace, pruning: dict | None, blocks: int) -> Engine:
    loggers: list[PeakStats] = []

    def factory(vllm_config: Any, engine_index: int) -> PeakStats:
        loggers.append(PeakStats(vllm_config, engine_index))
        return loggers[-1]

    engine_args = EngineArgs(
        model=str(path),
        dtype="float32",
        seed=0,
        max_model_len=1024,
        max_num_batched_tokens=8192,
        max_num_seqs=64,
        block_size=args.block_size,
        num_gpu_blocks_override=blocks,
        enforce_eager=True,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        disable_log_stats=False,
        distributed_executor_backend="uni",
        hf_overrides={"priortr": pruning} if pruning else {},
    )
    engine = LLMEngine.from_engine_args(engine_args, stat_loggers=[factory])
    return Engine(engine, loggers[0])


def request(question: str, seed: int, budget: int | None) -> dict:
    """A LLaVA-1.5 prompt with one random 336 x 336 image; ``budget``: this request's K."""
    pixels = (np.random.RandomState(seed).rand(IMAGE_SIZE, IMAGE_SIZE, 3) * 255).astype("uint8")
    out: dict[str, Any] = {
        "prompt": f"<s>USER: <image>\n{question} ASSISTANT:",
        "multi_modal_data": {"image": Image.fromarray(pixels)},
    }
    if budget is not None:
        out["mm_processor_kwargs"] = {"priortr": {"budget": budget}}
    return out


def prompt_ids(path: Path, item: dict) -> list[int]:
    """The token ids of a stock request's prompt (every image with its N tokens), from the processor."""
    processor = LlavaProcessor.from_pretrained(path)
    inputs = processor(
        text=item["prompt"], images=item["multi_modal_data"]["image"], add_special_tokens=False
    )
    return inputs["input_ids"][0]


@dataclass
class Batch:
    """One batch of requests run to completion."""

    seconds: float
    requests: int
    output_tokens: int
    prompt_tokens: list[int]
    peak_running: int
    peak_usage: float
    preemptions: int

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_batch(engine: Engine, requests: list[dict], tokens: int, tag: str) -> Batch:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    engine.stats.reset()
    finished = []
    start = time.perf_counter()
    for index, item in enumerate(requests):
        engine.engine.add_request(f"{tag}-{index}", item, params)
    while engine.engine.has_unfinished_requests():
        finished += [output for output in engine.engine.step() if output.finished]
    seconds = time.perf_counter() - start
    return Batch(
        seconds=seconds,
        requests=len(finished),
        output_tokens=sum(len(output.outputs[0].token_ids) for output in finished),
        prompt_tokens=sorted({len(output.prompt_token_ids) for output in finished}),
        peak_running=engine.stats.running,
        peak_usage=engine.stats.usage,
        preemptions=engine.stats.preempted,
    )


@dataclass
class Setting:
    """Results of one setting (stock, or a budget K)."""

    name: str
    budget: int | None
    prompt_tokens: int = 0
    kv_blocks: int = 0
    fits: int = 0
    batches: list[Batch] = field(default_factory=list)


def question(words: int) -> str:
    return " ".join(f"w{100 + i}" for i in range(words))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hidden", type=int, default=1024, help="text width (a multiple of the head size 128)"
    )
    parser.add_argument("--layers", type=int, default=8, help="decoder layers")
    parser.add_argument("--layer", type=int, default=2, help="the scored layer L")
    parser.add_argument("--budgets", type=int, nargs="+", default=[192, 128, 64])
    parser.add_argument("--text-words", type=int, default=40, help="words of the question")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--requests", type=int, default=12, help="requests per throughput batch")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per KV block")
    parser.add_argument("--cache-requests", type=int, default=2, help="KV cache size, in stock requests")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm-cpu"))
    args = parser.parse_args()
    began, load_before = time.perf_counter(), os.getloadavg()
    text = question(args.text_words)
    settings = [Setting(STOCK, None), *(Setting(f"K={k}", k) for k in args.budgets)]
    with tempfile.TemporaryDirectory() as folder:
        path = build_checkpoint(Path(folder), args.hidden, args.layers, seed=0)
        # The cache: --cache-requests stock requests to the end of their output, and vLLM's null block.
        stock_prompt = len(prompt_ids(path, request(text, 0, None)))
        blocks = args.cache_requests * math.ceil((stock_prompt + args.tokens) / args.block_size) + 1
        stock = start_engine(path, args, None, blocks)
        pruned = start_engine(
            path,
            args,
            {
                "method": "priortr",
                "budget": args.budgets[0],
                "layer": args.layer,
                "request_budgets": list(args.budgets),
            },
            blocks,
        )
        engines = {s.name: stock if s.budget is None else pruned for s in settings}
        seed = 0
        for setting in settings:  # one request alone: its blocks (also the warm-up)
            seed += 1
            alone = run_batch(
                engines[setting.name], [request(text, seed, setting.budget)], args.tokens, setting.name
            )
            setting.prompt_tokens = alone.prompt_tokens[0]
            setting.kv_blocks = round(alone.peak_usage * (blocks - 1))
            setting.fits = (blocks - 1) // math.ceil((setting.prompt_tokens + args.tokens) / args.block_size)
        for round_ in range(args.rounds):
            order = settings[round_ % len(settings) :] + settings[: round_ % len(settings)]
            for setting in order:
                items = []
                for _ in range(args.requests):
                    seed += 1
                    items.append(request(text, seed, setting.budget))
                batch = run_batch(engines[setting.name], items, args.tokens, f"{setting.name}-r{round_}")
                setting.batches.append(batch)
                print(
                    f"round {round_} {setting.name}: {batch.seconds:.1f} s, "
                    f"peak running {batch.peak_running}, preemptions {batch.preemptions}",
                    flush=True,
                )
    report = {
        "command": "python benchmarks/vllm_serving.py " + " ".join(_argv(args)),
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "head_dim": 128,
            "visual_tokens": (IMAGE_SIZE // PATCH) ** 2,
            "vocab": VOCAB,
        },
        "kv_cache_blocks": blocks - 1,
        "block_size": args.block_size,
        "wall_seconds": round(time.perf_counter() - began, 1),
        "settings": [
            {
                **{k: v for k, v in asdict(s).items() if k != "batches"},
                "batches": [_batch_json(b) for b in s.batches],
            }
            for s in settings
        ],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "vllm.md").write_text(markdown(report, settings, args) + "\n")
    print(markdown(report, settings, args))


def _batch_json(batch: Batch) -> dict:
    return {**asdict(batch), "requests_per_s": batch.requests_per_s, "tokens_per_s": batch.tokens_per_s}


def markdown(report: dict, settings: list[Setting], args: argparse.Namespace) -> str:
    """The results table: ratios against stock from the medians over rounds."""
    base = settings[0]
    base_rps = statistics.median(b.requests_per_s for b in base.batches)
    lines = [
        f"{report['kv_cache_blocks']} KV blocks of {args.block_size} tokens; {args.requests} requests per "
        f"batch, {args.tokens} output tokens each; median [min, max] of {args.rounds} rounds",
        "",
        "| setting | prompt tokens | KV blocks / request | fewer blocks | requests the cache holds "
        "| more requests | peak running | preemptions | requests/s | output tokens/s | throughput vs stock |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in settings:
        rps = [b.requests_per_s for b in s.batches]
        tps = [b.tokens_per_s for b in s.batches]
        lines.append(
            f"| {s.name} | {s.prompt_tokens} | {s.kv_blocks} | {base.kv_blocks / s.kv_blocks:.2f}x "
            f"| {s.fits} | {s.fits / base.fits:.1f}x | {max(b.peak_running for b in s.batches)} "
            f"| {sum(b.preemptions for b in s.batches)} | {_spread(rps, 3)} | {_spread(tps, 1)} "
            f"| {statistics.median(rps) / base_rps:.2f}x |"
        )
    return "\n".join(lines)


def _spread(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def _argv(args: argparse.Namespace) -> list[str]:
    out = []
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        out += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return out


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for the report."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    main()
