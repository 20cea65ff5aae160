"""Tiny Gemma 4 models of the three released shapes, and batches laid out as ``Gemma4Processor`` writes
prompts.

An image is ``<|image> <|image|> x N <image|>`` (``Gemma4Processor.replace_image_token``). The vision
tower embeds patches (``patch_size``), runs its encoder and average-pools ``pooling_kernel_size`` x
``pooling_kernel_size`` patches into one token: N is what the caller asked the processor for (70-1120 in
the released models); here an image is ``GRID`` x ``GRID`` patches pooled 2 x 2 into ``IMAGE_TOKENS``
tokens, passed as the processor passes them (``pixel_values`` [images, patches, 3 * patch ** 2] and the
patches' (x, y) in ``image_position_ids``). ``mm_token_type_ids`` (1 on image tokens) lets the tokens of
one image attend to each other in both directions on the sliding-window layers, at prefill, in models
with ``use_bidirectional_attention="vision"``.

The text model's shapes (``Gemma4TextConfig``, shrunk):

* ``dense`` (the 31B's): sliding-window and global layers (``LAYER_TYPES``, window ``WINDOW``); global
  layers with their own head size (``global_head_dim``), one KV head, keys reused as values
  (``attention_k_eq_v``) and a quarter of each head rotated (proportional RoPE);
* ``e2b`` (the E2B/E4B on-device shape): per-layer inputs (``hidden_size_per_layer_input``) and KV
  sharing (the last ``SHARED`` layers of ``E2B_LAYER_TYPES`` read the keys and values of the last earlier
  layer of their type), double-wide MLPs on the shared layers; bidirectional image attention off (causal,
  the other mask path);
* ``moe`` (the 26B-A4B's): the dense shape with a mixture-of-experts block beside each MLP.

Same conventions as ``tests.helpers.tiny``: special ids at the top of the vocabulary, random text from
``[TEXT_LO, TEXT_HI)``, left padding, row ``r`` depends only on ``(seed, r)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import Gemma4Config, Gemma4ForConditionalGeneration

from tests.helpers.tiny import (
    BOS_ID,
    PAD_ID,
    TEXT_CONFIG,
    VOCAB,
    Batch,
    finish_model,
    left_pad,
    random_text,
    row_generator,
    row_lengths,
)

GEMMA4_IMAGE_ID, GEMMA4_START_ID, GEMMA4_END_ID, GEMMA4_VIDEO_ID = 199, 198, 197, 196
PATCH, POOL, GRID = 2, 2, 8
IMAGE_TOKENS = GRID * GRID // POOL**2  # 16
LAYER_TYPES = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
]
E2B_LAYER_TYPES = [*LAYER_TYPES[:4], "sliding_attention", "full_attention"]
SHARED = 2  # E2B: layers 4 (sliding) and 5 (global) read the keys of layers 3 and 2
WINDOW = 8
SHAPES = ("dense", "e2b", "moe")

_SHAPE_TEXT: dict[str, dict[str, Any]] = {
    "dense": {
        "layer_types": LAYER_TYPES,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "use_bidirectional_attention": "vision",
        "hidden_size_per_layer_input": 0,
    },
    "e2b": {
        "layer_types": E2B_LAYER_TYPES,
        "num_kv_shared_layers": SHARED,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
        "use_double_wide_mlp": True,
    },
    "moe": {
        "layer_types": LAYER_TYPES,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "use_bidirectional_attention": "vision",
        "hidden_size_per_layer_input": 0,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    },
}


def tiny_gemma4(
    dtype: torch.dtype = torch.float64,
    attn: str = "sdpa",
    seed: int = 0,
    shape: str = "dense",
    window: int = WINDOW,
) -> Gemma4ForConditionalGeneration:
    """A Gemma 4 of ``shape`` (``SHAPES``): 5 text layers (6 for ``e2b``), sliding window ``window``, 2 vision
    layers; one image becomes ``IMAGE_TOKENS`` visual tokens. The experts of ``moe`` run eagerly, since the
    default grouped_mm kernel refuses float64."""
    text = {
        **TEXT_CONFIG,
        "head_dim": 16,
        "global_head_dim": 32,
        "sliding_window": window,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 10000.0,
            },
        },
        **_SHAPE_TEXT[shape],
    }
    text["num_hidden_layers"] = len(text["layer_types"])
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "patch_size": PATCH,
        "pooling_kernel_size": POOL,
        "position_embedding_size": 64,
    }
    config = Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        boi_token_id=GEMMA4_START_ID,
        eoi_token_id=GEMMA4_END_ID,
        image_token_id=GEMMA4_IMAGE_ID,
        video_token_id=GEMMA4_VIDEO_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration._from_config(
        config, attn_implementation=attn, dtype=dtype, experts_implementation="eager"
    )
    with torch.no_grad():  # transformers initialises it to ones: every patch would get one position
        model.model.vision_tower.patch_embedder.position_embedding_table.normal_(std=0.5)
    return finish_model(model, attn)


def tiny_gemma4_e2b(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0, window: int = WINDOW
):
    """``tiny_gemma4`` of the E2B/E4B shape: per-layer inputs and KV sharing."""
    return tiny_gemma4(dtype, attn, seed, "e2b", window)


def tiny_gemma4_moe(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0, window: int = WINDOW
):
    """``tiny_gemma4`` of the MoE shape."""
    return tiny_gemma4(dtype, attn, seed, "moe", window)


def _patch_positions() -> torch.Tensor:
    """[GRID * GRID, 2] each patch's (x, y), row-major, as the image processor writes them."""
    index = torch.arange(GRID * GRID)
    return torch.stack([index % GRID, index // GRID], dim=1)


def gemma4_batch(model, batch_size: int = 1, images: int | Sequence[int] = 1, seed: int = 0) -> Batch:
    """Rows ``[bos, text x a, image, (text x 2, image)..., text x b]``, left-padded; ``images`` images per
    row, or row ``r`` holds ``images[r]``."""
    image = [GEMMA4_START_ID, *[GEMMA4_IMAGE_ID] * IMAGE_TOKENS, GEMMA4_END_ID]
    counts = [images] * batch_size if isinstance(images, int) else list(images)
    rows, pixels = [], []
    lengths = zip(row_lengths((3,), batch_size), row_lengths((5,), batch_size), strict=True)
    for r, (a, b) in enumerate(lengths):
        gen = row_generator(seed, r)
        row = [BOS_ID, *random_text(a, gen)]
        for k in range(counts[r]):
            row += [*(random_text(2, gen) if k else []), *image]
            pixels.append(torch.rand((GRID * GRID, 3 * PATCH * PATCH), generator=gen))
        rows.append([*row, *random_text(b, gen)])
    ids, mask, _, _ = left_pad(rows, [(0, 0)] * batch_size)
    return Batch(
        ids,
        mask,
        torch.stack(pixels).to(model.dtype),
        [],
        [],
        0,
        mm_token_type_ids=(ids == GEMMA4_IMAGE_ID).long(),
        visual_ids=(GEMMA4_IMAGE_ID,),
        extra={"image_position_ids": _patch_positions().expand(len(pixels), -1, -1).clone()},
        images_per_row=None if isinstance(images, int) else counts,
    )


def gemma4_multi_image_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    return gemma4_batch(model, batch_size, images=2, seed=seed)


def gemma4_ragged_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """Alternately one image and two per row (16 and 32 visual tokens)."""
    return gemma4_batch(model, batch_size, images=[1 + r % 2 for r in range(batch_size)], seed=seed)
