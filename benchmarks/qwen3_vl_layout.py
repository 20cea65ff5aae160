"""A random-weight Qwen3-VL-8B layout for the serving benchmark (``vllm_bench_serve.py --family
qwen3-vl``), built offline into a checkpoint directory vLLM's CPU build loads.

The text model is Qwen3-VL-8B's (head size 128, 4 query heads per key/value head, q/k norms, MLP ratio
12288 / 4096, vocabulary 151936, untied output embedding, interleaved M-RoPE with sections 24 / 20 / 20,
theta 5e6) at a narrower width and depth (``hidden``, ``layers``), as ``vllm_serving.build_checkpoint``
scales LLaVA-1.5-7B. The vision tower keeps what sets the visual token count and DeepStack: 16-px
patches, 2 frames per patch, 2 x 2 spatial merge, the 48 x 48 learned position grid, and three
DeepStack levels (J = 3, as in the released models: features for decoder layers 0, 1 and 2); it is
cut to one block per level, 64 wide (the released tower, 27 blocks of width 1152, takes about 32 s a
512 x 512 image on one core of the project's CPU, measured block by block; the encoder's cost is the
same with and without pruning). The image processor is pinned to IMAGE_SIZE x IMAGE_SIZE pixels, so
every image is IMAGE_TOKENS visual tokens and vLLM sizes its encoder budget for that, not for the
released processor's 16-megapixel bound.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from tests.helpers.tiny import PAD_ID, qwen_special_ids
from tests.vllm.checkpoints import QWEN_TEMPLATE, qwen_tokenizer, store_experts_as_released

VOCAB = 151936
HEAD_DIM = 128
HEADS_PER_KV_HEAD = 4  # Qwen3-VL-8B: 32 query heads, 8 key/value heads
PATCH, MERGE = 16, 2
IMAGE_SIZE = 768
IMAGE_TOKENS = (IMAGE_SIZE // (PATCH * MERGE)) ** 2  # 24 x 24 merged patches: 576
DEEPSTACK_LEVELS = 3
EXPERTS, EXPERTS_PER_TOKEN = 32, 8
"""The MoE layout's routing: Qwen3-VL-30B-A3B's top-8, of 32 experts where it has 128 (the weights of
128 experts at width 512 and 8 layers would be 1.2 GB of float32 per server, and a token's FLOPs
depend on the 8 experts it runs, not on how many there are)."""
EXPERT_WIDTH_RATIO = 768 / 2048
"""Qwen3-VL-30B-A3B's ``moe_intermediate_size`` over its ``hidden_size``."""
CHAT_TEMPLATE = QWEN_TEMPLATE
"""``USER: <|vision_start|><|image_pad|><|vision_end|>{question} ASSISTANT:``: the image, then the
question (the method scores the text after the image)."""
TEMPLATE_TOKENS = 4
"""What the chat template adds around the question: ``USER:``, ``<|vision_start|>``, ``<|vision_end|>``,
``ASSISTANT:``."""


def qwen3_vl_config(hidden: int, layers: int, moe: bool = False) -> Qwen3VLConfig | Qwen3VLMoeConfig:
    """The layout's config (see the module docstring) at text width ``hidden`` (a multiple of 128) and
    ``layers`` decoder layers; ``moe``: every decoder layer's MLP a sparse MoE block, routed as
    Qwen3-VL-30B-A3B's (EXPERTS, EXPERTS_PER_TOKEN, EXPERT_WIDTH_RATIO)."""
    heads = hidden // HEAD_DIM
    experts = {
        "num_experts": EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "moe_intermediate_size": round(hidden * EXPERT_WIDTH_RATIO),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    text = {
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": hidden * 12288 // 4096,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // HEADS_PER_KV_HEAD),
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
        **(experts if moe else {}),
    }
    vision = {
        "depth": DEEPSTACK_LEVELS,
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_heads": 2,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "out_hidden_size": hidden,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": list(range(DEEPSTACK_LEVELS)),
    }
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=text,
        vision_config=vision,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
        **qwen_special_ids(),
    )


def build_qwen3_vl_checkpoint(path: Path, hidden: int, layers: int, seed: int, moe: bool = False) -> Path:
    """Write the layout at ``hidden`` / ``layers`` (``qwen3_vl_config``, MoE if ``moe``), random weights
    drawn from ``seed``, and its processor to ``path``."""
    torch.manual_seed(seed)
    kind = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    model = kind._from_config(qwen3_vl_config(hidden, layers, moe), dtype=torch.float32)
    model.eval().save_pretrained(path)
    qwen3_vl_processor().save_pretrained(path)
    return path


def build_qwen3_vl_moe_checkpoint(path: Path, hidden: int, layers: int, seed: int) -> Path:
    """``build_qwen3_vl_checkpoint`` with MoE MLPs (Qwen3-VL-30B-A3B's routing), stored as the released
    checkpoints are: the experts' weights in their layout, and ``norm_topk_prob`` in the text config,
    which vLLM reads and transformers' config class drops (its router always renormalises)."""
    build_qwen3_vl_checkpoint(path, hidden, layers, seed, moe=True)
    store_experts_as_released(path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["norm_topk_prob"] = True
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def qwen3_vl_processor() -> Qwen3VLProcessor:
    """The layout's processor: images pinned to IMAGE_SIZE x IMAGE_SIZE pixels (IMAGE_TOKENS visual
    tokens each), a word-level tokenizer of the layout's vocabulary, CHAT_TEMPLATE."""
    pixels = IMAGE_SIZE * IMAGE_SIZE
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(
            patch_size=PATCH, merge_size=MERGE, min_pixels=pixels, max_pixels=pixels
        ),
        video_processor=Qwen3VLVideoProcessor(size={"shortest_edge": pixels, "longest_edge": pixels}),
        tokenizer=qwen_tokenizer(VOCAB),
        chat_template=CHAT_TEMPLATE,
    )
