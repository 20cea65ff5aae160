"""A tiny Gemma 3 and batches laid out as ``Gemma3Processor`` writes prompts.

An image is ``<start_of_image> <image_soft_token> x mm_tokens_per_image <end_of_image>`` (the processor
also writes ``\\n\\n`` around it; plain text here). ``token_type_ids`` is 1 on the image tokens: the model
then lets the tokens of one image attend to each other in both directions (prefill only), under the
layer's sliding window where it has one.

The text model mixes sliding-window and global layers (``LAYER_TYPES``; released models: five sliding
layers per global one, window 512-1024) with a small window (``WINDOW``), so that the prompts below cross
it and decoding slides past it; sliding and global layers have their own RoPE bases.

Same conventions as ``tests.helpers.tiny``: special ids at the top of the vocabulary, random text from
``[TEXT_LO, TEXT_HI)``, left padding, row ``r`` depends only on ``(seed, r)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from tests.helpers.tiny import (
    BOS_ID,
    PAD_ID,
    TEXT_CONFIG,
    Batch,
    finish_model,
    left_pad,
    random_text,
    row_generator,
    row_lengths,
)

GEMMA3_IMAGE_ID, GEMMA3_START_ID, GEMMA3_END_ID = 199, 198, 197
IMAGE_TOKENS = 16  # 8x8 patches of a 32 px image, pooled 2x2
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
WINDOW = 8

_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
}


def tiny_gemma3(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0, window: int = WINDOW
) -> Gemma3ForConditionalGeneration:
    """A 4-layer Gemma 3 text model (``LAYER_TYPES``, sliding window ``window``) + 2-layer SigLIP; one
    32x32 image becomes ``IMAGE_TOKENS`` visual tokens."""
    text = {
        **TEXT_CONFIG,
        "head_dim": 16,
        "layer_types": LAYER_TYPES,
        "sliding_window": window,
        "query_pre_attn_scalar": 16,
        "rope_parameters": _ROPE,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 4,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=IMAGE_TOKENS,
        boi_token_index=GEMMA3_START_ID,
        eoi_token_index=GEMMA3_END_ID,
        image_token_index=GEMMA3_IMAGE_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    with torch.no_grad():  # transformers initialises it to zeros, which would make every image token alike
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.5)
    return finish_model(model, attn)


def gemma3_batch(model, batch_size: int = 1, images: int | Sequence[int] = 1, seed: int = 0) -> Batch:
    """Rows ``[bos, text x a, image, (text x 2, image)..., text x b]``, left-padded; ``images`` images per
    row, or row ``r`` holds ``images[r]``."""
    size = model.config.vision_config.image_size
    image = [GEMMA3_START_ID, *[GEMMA3_IMAGE_ID] * IMAGE_TOKENS, GEMMA3_END_ID]
    counts = [images] * batch_size if isinstance(images, int) else list(images)
    rows, pixels = [], []
    lengths = zip(row_lengths((3,), batch_size), row_lengths((5,), batch_size), strict=True)
    for r, (a, b) in enumerate(lengths):
        gen = row_generator(seed, r)
        row = [BOS_ID, *random_text(a, gen)]
        for k in range(counts[r]):
            row += [*(random_text(2, gen) if k else []), *image]
            pixels.append(torch.randn((3, size, size), generator=gen))
        rows.append([*row, *random_text(b, gen)])
    ids, mask, _, _ = left_pad(rows, [(0, 0)] * batch_size)
    return Batch(
        ids,
        mask,
        torch.stack(pixels).to(model.dtype),
        [],
        [],
        0,
        visual_ids=(GEMMA3_IMAGE_ID,),
        extra={"token_type_ids": (ids == GEMMA3_IMAGE_ID).long()},
        images_per_row=None if isinstance(images, int) else counts,
    )


def gemma3_multi_image_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    return gemma3_batch(model, batch_size, images=2, seed=seed)


def gemma3_ragged_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """Alternately one image and two per row (16 and 32 visual tokens)."""
    return gemma3_batch(model, batch_size, images=[1 + r % 2 for r in range(batch_size)], seed=seed)
