"""Tiny LLaVA-NeXT, LLaVA-OneVision and Video-LLaVA models and their batches (see ``tests/helpers/tiny.py``).

Same conventions as ``tests/helpers/tiny.py``: random weights from a seed, a 4-layer text model of the shared
``TEXT_CONFIG`` sizes, vocabulary ``VOCAB`` with the special ids at the top, left-padded rows of different
text lengths, row ``r`` depending only on ``(seed, r)``. Every vision tower sees 28 x 28 crops in 7 x 7
patches: 16 patch tokens per crop.

Visual-token counts are not computed here by a formula: ``feature_lengths`` asks the model's own
``get_image_features`` / ``get_video_features`` how many features each image or video yields, so the
placeholder runs always match what ``forward`` scatters (a mismatch raises inside transformers).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence

import torch
import transformers
from packaging.version import Version
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    SiglipVisionConfig,
    VideoLlavaConfig,
    VideoLlavaForConditionalGeneration,
)
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

from tests.helpers.tiny import (
    BOS_ID,
    LLAVA_IMAGE_ID,
    PAD_ID,
    TEXT_CONFIG,
    Batch,
    finish_model,
    left_pad,
    random_text,
    row_generator,
    row_lengths,
)

IMAGE_ID = LLAVA_IMAGE_ID  # 199
VIDEO_ID = 198
CROP, PATCH = 28, 7  # 4 x 4 patches per crop
NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]  # LLaVA-NeXT's, in 28-px tiles
OV_PINPOINTS = [[28 * i, 28 * j] for i in (1, 2, 3) for j in (1, 2, 3)]
OV_MAX_TILES = 2  # "anyres_max_2": grids above 2 tiles of area are downsampled, as 9 are in the real model
VIDEO_FRAMES = {"llava_onevision": 3, "video_llava": 2}


def _tower(config_class: type, **extra) -> PreTrainedConfig:
    return config_class(
        image_size=CROP,
        patch_size=PATCH,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        **extra,
    )


def _build(model_class: type, config, attn: str, dtype: torch.dtype, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    return finish_model(model_class._from_config(config, attn_implementation=attn, dtype=dtype), attn)


def tiny_llava_next(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> LlavaNextForConditionalGeneration:
    """A 4-layer Llama + 2-layer CLIP LLaVA-NeXT; AnyRes tiles of 28 px on LLaVA-NeXT's pinpoint shapes."""
    config = LlavaNextConfig(
        vision_config=_tower(CLIPVisionConfig, projection_dim=32),
        text_config=LlamaConfig(**TEXT_CONFIG),
        image_token_id=IMAGE_ID,
        image_grid_pinpoints=NEXT_PINPOINTS,
        image_seq_length=(CROP // PATCH) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        pad_token_id=PAD_ID,
    )
    return _build(LlavaNextForConditionalGeneration, config, attn, dtype, seed)


def tiny_llava_onevision(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> LlavaOnevisionForConditionalGeneration:
    """A 4-layer Qwen2 + 2-layer SigLIP LLaVA-OneVision (no [CLS]: ``full`` features of the last layer)."""
    config = LlavaOnevisionConfig(
        vision_config=_tower(SiglipVisionConfig, vision_use_head=False),
        text_config=Qwen2Config(**TEXT_CONFIG),
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        image_grid_pinpoints=OV_PINPOINTS,
        vision_aspect_ratio=f"anyres_max_{OV_MAX_TILES}",
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        pad_token_id=PAD_ID,
    )
    return _build(LlavaOnevisionForConditionalGeneration, config, attn, dtype, seed)


def tiny_video_llava(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> VideoLlavaForConditionalGeneration:
    """A 4-layer Llama Video-LLaVA with two 2-layer CLIP towers: 16 tokens per image, 17 per frame."""
    frames = VIDEO_FRAMES["video_llava"]
    n_patches = (CROP // PATCH) ** 2
    config = VideoLlavaConfig(
        vision_config=_tower(CLIPVisionConfig, projection_dim=32),
        text_config=LlamaConfig(**TEXT_CONFIG),
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        image_seq_length=n_patches,
        video_seq_length=frames * (n_patches + 1),
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        pad_token_id=PAD_ID,
    )
    return _build(VideoLlavaForConditionalGeneration, config, attn, dtype, seed)


# -- inputs ------------------------------------------------------------------------------------------


def feature_lengths(model: PreTrainedModel, **inputs) -> list[int]:
    """Visual tokens per image (``pixel_values``) or per video (``pixel_values_videos``), by the model."""
    with torch.no_grad():
        if "pixel_values_videos" in inputs:
            # [videos, n, D] (OneVision) or [videos * frames, n / frames, D] (Video-LLaVA)
            videos = inputs["pixel_values_videos"].shape[0]
            # positional: the argument is ``pixel_values`` for OneVision before transformers 5.23
            features = model.model.get_video_features(inputs.pop("pixel_values_videos"), **inputs)
            features = getattr(features, "pooler_output", features)
            return [features.shape[0] * features.shape[1] // videos] * videos
        else:
            features = model.model.get_image_features(**inputs).pooler_output  # list or [images, n, D]
    return [int(f.shape[0]) for f in features]


def anyres_pixels(
    model: PreTrainedModel, sizes: Sequence[tuple[int, int]], gen: torch.Generator
) -> torch.Tensor:
    """[images, max crops, 3, 28, 28] random crops, zero-padded to the most crops, as the processor pads."""
    counts = [image_size_to_num_patches(list(s), model.config.image_grid_pinpoints, CROP) for s in sizes]
    pixels = torch.zeros(len(sizes), max(counts), 3, CROP, CROP)
    for i, n in enumerate(counts):
        pixels[i, :n] = torch.randn(n, 3, CROP, CROP, generator=gen)
    return pixels.to(model.dtype)


def _frames(model: PreTrainedModel, videos: int, gen: torch.Generator) -> torch.Tensor:
    """[videos, frames, 3, 28, 28] random frames."""
    frames = VIDEO_FRAMES[model.config.model_type]
    return torch.randn(videos, frames, 3, CROP, CROP, generator=gen).to(model.dtype)


def _row(
    gen: torch.Generator, before: int, after: int, *items: tuple[int, int], between: int = 2
) -> list[int]:
    """``[bos, text x before, item, text x between, item, ..., text x (1 + after)]``; an item is
    ``(placeholder id, count)``. Every item is followed by a text token, its separator."""
    row = [BOS_ID, *random_text(before, gen)]
    for index, (token_id, count) in enumerate(items):
        row += [token_id] * count
        row += random_text(1 + after if index == len(items) - 1 else between, gen)
    return row


def _lengths(batch_size: int) -> Iterator[tuple[int, int]]:
    """Per row, (text before, text after) as ``llava_batch`` draws them: (3, 5), (5, 7), ..."""
    return zip(row_lengths((3,), batch_size), row_lengths((5,), batch_size), strict=True)


def _one_run_batch(rows: list[list[int]], token_id: int, n_visual: int, pixels, **fields) -> Batch:
    """A batch whose rows hold one run of ``n_visual`` ``token_id`` each (spans filled)."""
    starts = [row.index(token_id) for row in rows]
    ids, mask, starts, ends = left_pad(rows, [(s, s + n_visual) for s in starts])
    return Batch(ids, mask, pixels, starts, ends, n_visual, **fields)


def _anyres_batch(model, batch_size: int, size: tuple[int, int], seed: int, **extra) -> Batch:
    """One ``size`` image per row, every row the same AnyRes token count."""
    sizes = torch.tensor([size] * batch_size)
    pixels = torch.cat([anyres_pixels(model, [size], row_generator(seed, r)) for r in range(batch_size)])
    first = {key: value[:1] for key, value in extra.items()}
    n_visual = feature_lengths(model, pixel_values=pixels[:1], image_sizes=sizes[:1], **first)[0]
    rows = [
        _row(row_generator(seed + 1, r), a, b, (IMAGE_ID, n_visual))
        for r, (a, b) in enumerate(_lengths(batch_size))
    ]
    return _one_run_batch(rows, IMAGE_ID, n_visual, pixels, extra={"image_sizes": sizes, **extra})


def llava_next_batch(model: LlavaNextForConditionalGeneration, batch_size: int = 1, seed: int = 0) -> Batch:
    """One 40 x 60 image per row: base crop (16) + the 2 x 2-tile grid (8 x 8 patches) unpadded to 6 x 8
    + 6 newlines = 70 ``<image>`` tokens, then an instruction; ``image_sizes`` in ``extra``."""
    return _anyres_batch(model, batch_size, (40, 60), seed)


def llava_onevision_batch(
    model: LlavaOnevisionForConditionalGeneration, batch_size: int = 1, seed: int = 0
) -> Batch:
    """One 50 x 80 image per row (single-image AnyRes; the 2 x 3-tile grid is downsampled by the
    ``anyres_max`` cap); ``image_sizes`` and ``batch_num_images`` (all 1, as the processor gives)."""
    return _anyres_batch(
        model, batch_size, (50, 80), seed, batch_num_images=torch.ones(batch_size, dtype=torch.long)
    )


RAGGED_SIZES = [(40, 60), (28, 28), (80, 30), (56, 56), (30, 70)]
"""Image sizes of the ragged rows: 70, 36, 66, 88 and 60 visual tokens in the tiny LLaVA-NeXT."""


def llava_next_ragged_batch(
    model: LlavaNextForConditionalGeneration, batch_size: int = 2, seed: int = 0
) -> Batch:
    """Row ``r`` holds one image of ``RAGGED_SIZES[r]``: every row a different number of ``<image>`` tokens.

    No single span or count describes the rows, so ``image_start``/``image_end`` are empty and
    ``n_visual`` is 0; ``visual_ids`` marks the visual tokens. ``pixel_values`` [B, max crops, 3, H, W]
    pads the crop stacks as the processor does; the model keeps each image's own crops.
    """
    sizes = RAGGED_SIZES[:batch_size]
    assert len(sizes) == batch_size, f"at most {len(RAGGED_SIZES)} ragged rows"
    stacks = [anyres_pixels(model, [size], row_generator(seed, r))[0] for r, size in enumerate(sizes)]
    pixels = torch.nn.utils.rnn.pad_sequence(stacks, batch_first=True)  # zero crops after each image's own
    image_sizes = torch.tensor(sizes)
    counts = feature_lengths(model, pixel_values=pixels, image_sizes=image_sizes)
    assert len(set(counts)) == batch_size, counts
    rows = [
        _row(row_generator(seed + 1, r), a, b, (IMAGE_ID, counts[r]))
        for r, (a, b) in enumerate(_lengths(batch_size))
    ]
    ids, mask, _, _ = left_pad(rows, [(0, 0)] * batch_size)
    return Batch(ids, mask, pixels, [], [], 0, visual_ids=(IMAGE_ID,), extra={"image_sizes": image_sizes})


def _video_batch(model, batch_size: int, seed: int) -> Batch:
    """One video per row, then an instruction; ``pixel_values_videos`` in ``extra``, no images."""
    videos = torch.cat([_frames(model, 1, row_generator(seed, r)) for r in range(batch_size)])
    n_visual = feature_lengths(model, pixel_values_videos=videos[:1])[0]
    if model.config.model_type == "llava_onevision" and Version(transformers.__version__) < Version("5.23"):
        n_visual += 1  # older releases append the video's image_newline in forward, not get_video_features
    rows = [
        _row(row_generator(seed + 1, r), a, b, (VIDEO_ID, n_visual))
        for r, (a, b) in enumerate(_lengths(batch_size))
    ]
    return _one_run_batch(
        rows, VIDEO_ID, n_visual, None, visual_ids=(VIDEO_ID,), extra={"pixel_values_videos": videos}
    )


def llava_onevision_video_batch(
    model: LlavaOnevisionForConditionalGeneration, batch_size: int = 1, seed: int = 0
) -> Batch:
    """One 3-frame video per row: 3 x 2 x 2 pooled patches + 1 newline = 13 ``<video>`` tokens."""
    return _video_batch(model, batch_size, seed)


def video_llava_video_batch(
    model: VideoLlavaForConditionalGeneration, batch_size: int = 1, seed: int = 0
) -> Batch:
    """One 2-frame video per row: 2 x (16 patches + the frame's [CLS]) = 34 ``<video>`` tokens."""
    return _video_batch(model, batch_size, seed)


def _video_llava_images(model: VideoLlavaForConditionalGeneration, pixels: torch.Tensor) -> dict:
    """Video-LLaVA's image argument as ``Batch`` fields: ``pixel_values`` (transformers 5.23) or, in older
    5.x releases, ``pixel_values_images``."""
    if "pixel_values" not in inspect.signature(model.forward).parameters:
        return {"pixels": None, "extra": {"pixel_values_images": pixels}}
    return {"pixels": pixels, "extra": {}}


def video_llava_batch(model: VideoLlavaForConditionalGeneration, batch_size: int = 1, seed: int = 0) -> Batch:
    """One image per row (16 ``<image>`` tokens, the [CLS] dropped), then an instruction."""
    n_visual = model.config.image_seq_length
    pixels = torch.cat(
        [torch.randn(1, 3, CROP, CROP, generator=row_generator(seed, r)) for r in range(batch_size)]
    ).to(model.dtype)
    rows = [
        _row(row_generator(seed + 1, r), a, b, (IMAGE_ID, n_visual))
        for r, (a, b) in enumerate(_lengths(batch_size))
    ]
    images = _video_llava_images(model, pixels)
    return _one_run_batch(rows, IMAGE_ID, n_visual, images["pixels"], extra=images["extra"])


def llava_onevision_multi_image_batch(
    model: LlavaOnevisionForConditionalGeneration, batch_size: int = 1, seed: int = 0
) -> Batch:
    """Two images per row with text between and after. With ``batch_num_images`` = 2 OneVision encodes
    each image as its base crop only, plus one newline: 17 ``<image>`` tokens each, whatever its size."""
    sizes = [(40, 60), (60, 40)] * batch_size
    pixels = torch.cat(
        [anyres_pixels(model, sizes[:2], row_generator(seed, r))[:, :1] for r in range(batch_size)]
    )
    per_row = torch.full((batch_size,), 2, dtype=torch.long)
    counts = feature_lengths(
        model, pixel_values=pixels, image_sizes=torch.tensor(sizes), batch_num_images=per_row
    )
    rows = [
        _row(row_generator(seed + 1, r), a, b, (IMAGE_ID, counts[2 * r]), (IMAGE_ID, counts[2 * r + 1]))
        for r, (a, b) in enumerate(_lengths(batch_size))
    ]
    ids, mask, _, _ = left_pad(rows, [(0, 0)] * batch_size)
    extra = {"image_sizes": torch.tensor(sizes), "batch_num_images": per_row}
    return Batch(ids, mask, pixels, [], [], sum(counts[:2]), visual_ids=(IMAGE_ID,), extra=extra)


def video_llava_multi_image_batch(
    model: VideoLlavaForConditionalGeneration, batch_size: int = 1, seed: int = 0
) -> Batch:
    """An image, text, then a video and an instruction in every row: 16 ``<image>`` + 34 ``<video>``."""
    pixels = torch.cat(
        [torch.randn(1, 3, CROP, CROP, generator=row_generator(seed, r)) for r in range(batch_size)]
    ).to(model.dtype)
    videos = torch.cat([_frames(model, 1, row_generator(seed + 2, r)) for r in range(batch_size)])
    n_image = model.config.image_seq_length
    n_video = feature_lengths(model, pixel_values_videos=videos[:1])[0]
    rows = [
        _row(row_generator(seed + 1, r), a, b, (IMAGE_ID, n_image), (VIDEO_ID, n_video))
        for r, (a, b) in enumerate(_lengths(batch_size))
    ]
    ids, mask, _, _ = left_pad(rows, [(0, 0)] * batch_size)
    images = _video_llava_images(model, pixels)
    extra = {"pixel_values_videos": videos, **images["extra"]}
    return Batch(
        ids, mask, images["pixels"], [], [], n_image + n_video, visual_ids=(IMAGE_ID, VIDEO_ID), extra=extra
    )
