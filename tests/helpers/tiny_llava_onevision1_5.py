"""A tiny LLaVA-OneVision-1.5 and batches laid out as its processor (``Exaone4_5_Processor``) writes prompts.

The model is the stock ``LlavaOnevision15Config`` shrunk: a Qwen3 text model (q/k norms, 1-D RoPE) under
a RICE vision tower (a [CLS] token per frame, 2-D RoPE, 2x2 merge, no temporal patches). Prompt layout:

* image: ``<|vision_start|> <|image_pad|> x (h*w/4) <|vision_end|>`` (the chat template writes the markers,
  the processor expands the pad);
* video of ``t`` frames: ``<|vision_start|> <|video_pad|> x (t*h*w/4) <|vision_end|>``, one run, since the
  processor expands the pad by the whole ``video_grid_thw`` (no per-frame timestamps).

Pixels are ``[t*h*w, 3 * patch**2]`` rows, one frame per patch (the tower has no ``temporal_patch_size``).
Same ids as ``tests.helpers.tiny``'s Qwen builders; left padding; row ``r`` depends only on ``(seed, r)``.

``LlavaOnevision15ForConditionalGeneration`` is newer than the transformers floor (5.17): there, the
builder skips the test that asks for the model, naming the missing class.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.helpers.tiny import (
    PAD_ID,
    QWEN_IMAGE_ID,
    QWEN_VIDEO_ID,
    QWEN_VISION_END_ID,
    QWEN_VISION_START_ID,
    TEXT_CONFIG,
    Batch,
    finish_model,
    qwen_special_ids,
    random_text,
    row_generator,
    row_lengths,
)

_VISION = {
    "depth": 2,
    "hidden_size": 32,  # 2 heads of 16: 2-D vision RoPE needs hidden_size divisible by 4 * num_heads
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "out_hidden_size": TEXT_CONFIG["hidden_size"],
}


def tiny_llava_onevision1_5(dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0):
    """A 4-layer Qwen3 text model + 2-block RICE vision tower (patch 14, 2x2 merge)."""
    names = ("LlavaOnevision15Config", "LlavaOnevision15ForConditionalGeneration")
    if not all(hasattr(transformers, name) for name in names):
        pytest.skip(
            f"transformers {transformers.__version__} has no LlavaOnevision15ForConditionalGeneration "
            "(LLaVA-OneVision-1.5 came after the 5.17 floor)"
        )
    text = {
        **TEXT_CONFIG,
        "model_type": "qwen3",
        "head_dim": TEXT_CONFIG["hidden_size"] // TEXT_CONFIG["num_attention_heads"],
    }
    config = transformers.LlavaOnevision15Config(
        text_config=text, vision_config=_VISION, pad_token_id=PAD_ID, **qwen_special_ids()
    )
    torch.manual_seed(seed)
    model = transformers.LlavaOnevision15ForConditionalGeneration._from_config(
        config, attn_implementation=attn, dtype=dtype
    )
    return finish_model(model, attn)


def _segments_batch(model, rows: list[list[tuple[str, object]]], seed: int) -> Batch:
    """Left-padded rows of segments ``("text", n)``, ``("image", (1, h, w))``, ``("video", (t, h, w))``,
    pixels in prompt order (as the model scatters them into the placeholders)."""
    vision = model.config.vision_config
    merge = vision.spatial_merge_size
    patch_dim = vision.in_channels * vision.patch_size**2
    token_rows, grids = [], {"image": [], "video": []}
    pixels: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
    for r, segments in enumerate(rows):
        gen = row_generator(seed, r)
        tokens: list[int] = []
        for kind, spec in segments:
            if kind == "text":
                tokens += random_text(spec, gen)
                continue
            t, h, w = spec
            pad = QWEN_IMAGE_ID if kind == "image" else QWEN_VIDEO_ID
            tokens += [QWEN_VISION_START_ID, *[pad] * (t * h * w // merge**2), QWEN_VISION_END_ID]
            grids[kind].append(spec)
            pixels[kind].append(torch.randn((t * h * w, patch_dim), generator=gen))
        token_rows.append(tokens)
    seq_len = max(len(tokens) for tokens in token_rows)
    ids = torch.full((len(rows), seq_len), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, tokens in enumerate(token_rows):
        ids[r, seq_len - len(tokens) :] = torch.tensor(tokens)
        mask[r, seq_len - len(tokens) :] = 1
    extra = {}
    if grids["video"]:
        extra["pixel_values_videos"] = torch.cat(pixels["video"]).to(model.dtype)
        extra["video_grid_thw"] = torch.tensor(grids["video"], dtype=torch.long)
    return Batch(
        ids,
        mask,
        torch.cat(pixels["image"]).to(model.dtype) if grids["image"] else None,
        [],
        [],
        0,
        image_grid_thw=torch.tensor(grids["image"], dtype=torch.long) if grids["image"] else None,
        mm_token_type_ids=(ids == QWEN_IMAGE_ID).long() + 2 * (ids == QWEN_VIDEO_ID).long(),
        visual_ids=(QWEN_IMAGE_ID, QWEN_VIDEO_ID),
        extra=extra,
    )


def _text_lengths(batch_size: int) -> list[tuple[int, int]]:
    """Text before / after the visual part of each row: 3/5, 5/7, ... (rows differ, so left padding)."""
    return list(zip(row_lengths((3,), batch_size), row_lengths((5,), batch_size), strict=True))


def llava_onevision1_5_batch(
    model, batch_size: int = 1, grid: tuple[int, int, int] = (1, 6, 8), seed: int = 0
) -> Batch:
    """One image per row, ``grid`` patches (12 tokens by default) in every row."""
    rows = [[("text", a), ("image", grid), ("text", b)] for a, b in _text_lengths(batch_size)]
    return _segments_batch(model, rows, seed)


RAGGED_GRIDS = ((1, 4, 4), (1, 6, 8))  # 4 and 12 tokens


def llava_onevision1_5_ragged_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """One image per row, 4 tokens in even rows and 12 in odd ones."""
    rows = [
        [("text", a), ("image", RAGGED_GRIDS[r % 2]), ("text", b)]
        for r, (a, b) in enumerate(_text_lengths(batch_size))
    ]
    return _segments_batch(model, rows, seed)


def llava_onevision1_5_video_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """One video per row: 2 frames of 4 tokens, one run of 8 ``<|video_pad|>``."""
    rows = [[("text", a), ("video", (2, 4, 4)), ("text", b)] for a, b in _text_lengths(batch_size)]
    return _segments_batch(model, rows, seed)


def llava_onevision1_5_multi_image_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """Two images per row, 4 then 12 tokens, with two text tokens between them."""
    rows = [
        [("text", a), ("image", (1, 4, 4)), ("text", 2), ("image", (1, 6, 8)), ("text", b)]
        for a, b in _text_lengths(batch_size)
    ]
    return _segments_batch(model, rows, seed)
