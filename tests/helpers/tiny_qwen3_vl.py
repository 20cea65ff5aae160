"""Tiny random-weight Qwen3-VL (dense and MoE) models and batches, laid out as ``Qwen3VLProcessor`` does.

Same vocabulary and special ids as ``tests.helpers.tiny``'s Qwen builders. The vision tower has 3 blocks and
DeepStack features after blocks 0 and 2, so the text model adds visual features to the outputs of its
decoder layers 0 and 1 (``INJECTED_LAYERS``), not of layer 2: a count read from the block indexes would
be wrong.

Prompt layout (transformers 5.23 ``Qwen3VLProcessor`` with the Qwen3-VL chat template, which writes
``<|vision_start|><|image_pad|><|vision_end|>`` / ``<|vision_start|><|video_pad|><|vision_end|>`` and the
processor expands only the pad token):

* image: ``<|vision_start|> <|image_pad|> x (h*w/4) <|vision_end|>``;
* video of ``t`` temporal patches: ``<|vision_start|>``, then per frame ``<t seconds>`` (a few text
  tokens here) ``<|vision_start|> <|video_pad|> x (h*w/4) <|vision_end|>``, then ``<|vision_end|>``.

``mm_token_type_ids`` is 1 on image pads and 2 on video pads, as the processor returns it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import (
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from tests.helpers.tiny import (
    PAD_ID,
    QWEN_IMAGE_ID,
    QWEN_VIDEO_ID,
    QWEN_VISION_END_ID,
    QWEN_VISION_START_ID,
    TEXT_CONFIG,
    Batch,
    finish_model,
    qwen_batch,
    qwen_special_ids,
    random_text,
    row_generator,
    row_lengths,
)

INJECTED_LAYERS = 2  # DeepStack features after vision blocks 0 and 2 -> decoder layers 0 and 1
TIMESTAMP_TOKENS = 3  # stands for the "<0.5 seconds>" text before each video frame

# head_dim 16 -> 8 rotary frequencies, interleaved T H W T H W T T as the real [24, 20, 20] sections are.
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": TEXT_CONFIG["hidden_size"],
    "num_position_embeddings": 64,  # an 8x8 learned grid, interpolated to each image's grid
    "deepstack_visual_indexes": [0, 2],
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0]}


def _text_config(**extra) -> dict:
    return {
        **TEXT_CONFIG,
        "head_dim": TEXT_CONFIG["hidden_size"] // TEXT_CONFIG["num_attention_heads"],
        "rope_parameters": _ROPE,
        **extra,
    }


def tiny_qwen3_vl(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> Qwen3VLForConditionalGeneration:
    """A 4-layer Qwen3-VL with a 3-block vision tower (patch 16, 2x2 merge, 2 frames per patch)."""
    config = Qwen3VLConfig(
        text_config=_text_config(), vision_config=_VISION, pad_token_id=PAD_ID, **qwen_special_ids()
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    return finish_model(model, attn)


def tiny_qwen3_vl_moe(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> Qwen3VLMoeForConditionalGeneration:
    """``tiny_qwen3_vl`` with 4-expert top-2 MoE MLPs in decoder layers 1-3 (layer 0 keeps a dense MLP); the
    experts run eagerly, since the default grouped_mm kernel refuses float64."""
    config = Qwen3VLMoeConfig(
        text_config=_text_config(**_MOE), vision_config=_VISION, pad_token_id=PAD_ID, **qwen_special_ids()
    )
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration._from_config(
        config, attn_implementation=attn, dtype=dtype, experts_implementation="eager"
    )
    return finish_model(model, attn)


def qwen3_vl_batch(
    model, batch_size: int = 1, grid: tuple[int, int, int] = (1, 6, 8), seed: int = 0
) -> Batch:
    """One image per row, ``grid`` patches (12 tokens by default) in every row: ``tiny.qwen_batch``,
    whose ``[text, <vision_start>, <image_pad> x N, <vision_end>, text]`` rows are Qwen3-VL's too."""
    return qwen_batch(model, batch_size=batch_size, grid=grid, seed=seed)


def _image(grid: Sequence[int], merge: int) -> list[int]:
    t, h, w = grid
    return [QWEN_VISION_START_ID, *[QWEN_IMAGE_ID] * (t * h * w // merge**2), QWEN_VISION_END_ID]


def _video(grid: Sequence[int], merge: int, gen: torch.Generator) -> list[int]:
    t, h, w = grid
    frame = [QWEN_VISION_START_ID, *[QWEN_VIDEO_ID] * (h * w // merge**2), QWEN_VISION_END_ID]
    frames = [token for _ in range(t) for token in [*random_text(TIMESTAMP_TOKENS, gen), *frame]]
    return [QWEN_VISION_START_ID, *frames, QWEN_VISION_END_ID]


def _segments_batch(model, rows: list[list[tuple[str, object]]], seed: int) -> Batch:
    """Left-padded rows of segments ``("text", n)``, ``("image", (t, h, w))``, ``("video", (t, h, w))``.

    Pixels come in prompt order (row by row), as the model's ``masked_scatter`` fills the placeholders.
    Row ``r``'s tokens and pixels depend only on ``(seed, r)`` and its segments.
    """
    vision = model.config.vision_config
    merge = vision.spatial_merge_size
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    token_rows, grids, pixels = [], {"image": [], "video": []}, {"image": [], "video": []}
    for r, segments in enumerate(rows):
        gen = row_generator(seed, r)
        tokens = []
        for kind, spec in segments:
            if kind == "text":
                tokens += random_text(spec, gen)
                continue
            tokens += _image(spec, merge) if kind == "image" else _video(spec, merge, gen)
            grids[kind].append(spec)
            pixels[kind].append(torch.randn((spec[0] * spec[1] * spec[2], patch_dim), generator=gen))
        token_rows.append(tokens)
    seq_len = max(len(tokens) for tokens in token_rows)
    ids = torch.full((len(rows), seq_len), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, tokens in enumerate(token_rows):
        ids[r, seq_len - len(tokens) :] = torch.tensor(tokens)
        mask[r, seq_len - len(tokens) :] = 1
    visual = (ids == QWEN_IMAGE_ID) | (ids == QWEN_VIDEO_ID)
    counts = visual.sum(1).unique()
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
        int(counts[0]) if counts.numel() == 1 else 0,  # visual tokens per row; 0 when rows differ
        image_grid_thw=torch.tensor(grids["image"], dtype=torch.long) if grids["image"] else None,
        mm_token_type_ids=(ids == QWEN_IMAGE_ID).long() + 2 * (ids == QWEN_VIDEO_ID).long(),
        visual_ids=(QWEN_IMAGE_ID, QWEN_VIDEO_ID),
        extra=extra,
    )


def _text_lengths(batch_size: int) -> list[tuple[int, int]]:
    """Text before / after the visual part of each row: 3/5, 5/7, 7/9, ... (rows differ, so left padding)."""
    return list(zip(row_lengths((3,), batch_size), row_lengths((5,), batch_size), strict=True))


RAGGED_GRIDS = ((1, 4, 4), (1, 4, 6), (1, 6, 8))  # 4, 6 and 12 tokens


def qwen3_vl_ragged_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """One image per row, row ``r`` with grid ``RAGGED_GRIDS[r % 3]``: different token counts per row."""
    rows = [
        [("text", a), ("image", RAGGED_GRIDS[r % len(RAGGED_GRIDS)]), ("text", b)]
        for r, (a, b) in enumerate(_text_lengths(batch_size))
    ]
    return _segments_batch(model, rows, seed)


def qwen3_vl_video_batch(
    model,
    batch_size: int = 2,
    grid: tuple[int, int, int] = (2, 4, 4),
    with_image: bool = False,
    seed: int = 0,
) -> Batch:
    """One video per row (``grid``: 2 frames of 4 tokens by default), each frame its own
    ``<|vision_start|> ... <|vision_end|>`` run after its timestamp; ``with_image`` puts a 4-token image
    before the video, so the model merges image and video DeepStack features."""
    image = [("image", (1, 4, 4)), ("text", 2)] if with_image else []
    rows = [[("text", a), *image, ("video", grid), ("text", b)] for a, b in _text_lengths(batch_size)]
    return _segments_batch(model, rows, seed)


def qwen3_vl_multi_image_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """Two images per row, 4 then 12 tokens, with two text tokens between them."""
    rows = [
        [("text", a), ("image", (1, 4, 4)), ("text", 2), ("image", (1, 6, 8)), ("text", b)]
        for a, b in _text_lengths(batch_size)
    ]
    return _segments_batch(model, rows, seed)


BATCHES = {
    "image": qwen3_vl_batch,
    "ragged": qwen3_vl_ragged_batch,
    "video": qwen3_vl_video_batch,
    "image+video": lambda model, batch_size: qwen3_vl_video_batch(model, batch_size, with_image=True),
    "multi-image": qwen3_vl_multi_image_batch,
}
"""Every batch builder, by layout: ``builder(model, batch_size) -> Batch``."""
