"""Tiny InternVL, SmolVLM and Idefics3 models and batches laid out as their processors write prompts.

* InternVL (``InternVLProcessor.replace_image_token``): an image is ``<img> <IMG_CONTEXT> x (N * tiles)
  </img>``; all tiles of one image (the dynamic-resolution crops and the thumbnail) share one run.
* SmolVLM / Idefics3 (``_prompt_split_image`` / ``Idefics3Processor.replace_image_token``): an image split
  into ``rows x cols`` sub-images is, row by row, ``<fake><row_i_col_j> <image> x N`` per sub-image and a
  ``\\n`` after each row, then ``\\n <fake><global-img> <image> x N <fake>`` for the downscaled whole image;
  an unsplit image is the global part alone. ``pixel_values`` are ``[B, max images, 3, H, W]``, each row's
  sub-images in prompt order (the global one last), zero-padded (the model drops all-zero images).

Same conventions as ``tests.helpers.tiny``: vocabulary of ``VOCAB`` ids, special ids at the top, random text
ids from ``[TEXT_LO, TEXT_HI)``, left padding, row ``r`` depends only on ``(seed, r)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    InternVLConfig,
    InternVLForConditionalGeneration,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
)

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

# InternVL special ids: <IMG_CONTEXT> (config.image_token_id), <img>, </img>.
INTERNVL_IMAGE_ID, INTERNVL_START_ID, INTERNVL_END_ID = 199, 198, 197
INTERNVL_IMAGE_SIZE, INTERNVL_PATCH_SIZE = 56, 7
# 8x8 patches, 2x2 pixel shuffle: 16 tokens per tile
INTERNVL_TILE_TOKENS = (INTERNVL_IMAGE_SIZE // INTERNVL_PATCH_SIZE // 2) ** 2

# SmolVLM / Idefics3 special ids: <image> (config.image_token_id), <fake_token_around_image>, <global-img>,
# "\n" (special here so that random text never forms it), <row_i_col_j> = ROW_COL_ID + 3 * (i-1) + (j-1).
SMOLVLM_IMAGE_ID, SMOLVLM_FAKE_ID, SMOLVLM_GLOBAL_ID, SMOLVLM_NEWLINE_ID = 199, 198, 197, 196
SMOLVLM_ROW_COL_ID = 190  # up to 2 rows x 3 cols of sub-images: ids 190..195
SMOLVLM_IMAGE_SIZE, SMOLVLM_PATCH_SIZE, SMOLVLM_SCALE = 42, 7, 2
SMOLVLM_SUB_TOKENS = (SMOLVLM_IMAGE_SIZE // SMOLVLM_PATCH_SIZE // SMOLVLM_SCALE) ** 2  # 6x6 patches -> 9


def tiny_internvl(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0, text: str = "qwen2"
) -> InternVLForConditionalGeneration:
    """A 4-layer Qwen2 (``text="qwen3"``: Qwen3, with q/k norms, as InternVL3.5) + 2-layer InternViT
    InternVL; one 56x56 tile becomes 16 visual tokens (8x8 patches, CLS dropped, 2x2 pixel shuffle)."""
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": INTERNVL_IMAGE_SIZE,
        "patch_size": INTERNVL_PATCH_SIZE,
    }
    text_config = Qwen3Config(**TEXT_CONFIG, head_dim=16) if text == "qwen3" else Qwen2Config(**TEXT_CONFIG)
    config = InternVLConfig(
        vision_config=vision,
        text_config=text_config,
        image_token_id=INTERNVL_IMAGE_ID,
        image_seq_length=INTERNVL_TILE_TOKENS,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    return finish_model(model, attn)


def _smolvlm_config(config_class: type, vision_model_type: str) -> Idefics3Config | SmolVLMConfig:
    vision = {
        "model_type": vision_model_type,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": SMOLVLM_IMAGE_SIZE,
        "patch_size": SMOLVLM_PATCH_SIZE,
    }
    return config_class(
        vision_config=vision,
        text_config=LlamaConfig(**TEXT_CONFIG),
        image_token_id=SMOLVLM_IMAGE_ID,
        scale_factor=SMOLVLM_SCALE,
        pad_token_id=PAD_ID,
    )


def tiny_smolvlm(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> SmolVLMForConditionalGeneration:
    """A 4-layer Llama + 2-layer SigLIP SmolVLM; a 42x42 sub-image becomes 9 visual tokens (6x6 patches,
    3x3 after the connector's pixel shuffle by 2)."""
    config = _smolvlm_config(SmolVLMConfig, "smolvlm_vision")
    torch.manual_seed(seed)
    model = SmolVLMForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    return finish_model(model, attn)


def tiny_idefics3(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> Idefics3ForConditionalGeneration:
    """``tiny_smolvlm``'s sizes as an Idefics3 model (same prompt layout and inputs)."""
    config = _smolvlm_config(Idefics3Config, "idefics3_vision")
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    return finish_model(model, attn)


# ---- InternVL batches ----------------------------------------------------------------------------------


def _internvl_rows(
    model: InternVLForConditionalGeneration,
    tiles: Sequence[Sequence[int]],
    seed: int,
    text_before: Sequence[int],
    text_after: Sequence[int],
) -> tuple[torch.LongTensor, torch.LongTensor, torch.Tensor, list[tuple[int, int]]]:
    """Rows ``[bos, text x a, image, (text x 2, image)..., text x b]``, an image of ``t`` tiles being
    ``<img> <IMG_CONTEXT> x 16*t </img>``; ``tiles[r]`` lists
    row ``r``'s images by tile count. Returns ids, mask, pixels [sum tiles, 3, H, W] in prompt order and
    each row's first image's ``[start, end)`` (after padding)."""
    n_tile = model.config.image_seq_length
    size = model.config.vision_config.image_size[0]
    batch_size = len(tiles)
    rows, ranges, pixels = [], [], []
    lengths = zip(row_lengths(text_before, batch_size), row_lengths(text_after, batch_size), strict=True)
    for r, (a, b) in enumerate(lengths):
        gen = row_generator(seed, r)
        row = [BOS_ID, *random_text(a, gen)]
        first = None
        for i, count in enumerate(tiles[r]):
            if i:
                row += random_text(2, gen)  # "\nImage-2: " between images
            start = len(row) + 1
            row += [INTERNVL_START_ID, *[INTERNVL_IMAGE_ID] * (n_tile * count), INTERNVL_END_ID]
            first = first or (start, start + n_tile * count)
            pixels.append(torch.randn((count, 3, size, size), generator=gen))
        rows.append(row + random_text(b, gen))
        ranges.append(first)
    ids, mask, starts, ends = left_pad(rows, ranges)
    spans = list(zip(starts, ends, strict=True))
    return ids, mask, torch.cat(pixels).to(model.dtype), spans


def internvl_batch(
    model: InternVLForConditionalGeneration,
    batch_size: int = 1,
    tiles: int = 1,
    seed: int = 0,
    text_before: Sequence[int] = (3,),
    text_after: Sequence[int] = (5,),
) -> Batch:
    """Rows ``[bos, text x a, <img>, <IMG_CONTEXT> x 16*tiles, </img>, text x b]``, left-padded, one image
    of ``tiles`` tiles per row; ``image_end`` is the ``</img>`` separator; pixels [B * tiles, 3, H, W]."""
    layout = [[tiles]] * batch_size
    ids, mask, pixels, spans = _internvl_rows(model, layout, seed, text_before, text_after)
    starts, ends = [s for s, _ in spans], [e for _, e in spans]
    return Batch(ids, mask, pixels, starts, ends, model.config.image_seq_length * tiles)


def internvl_tiles_batch(
    model: InternVLForConditionalGeneration, batch_size: int = 1, seed: int = 0
) -> Batch:
    """``internvl_batch`` with one image of 3 tiles per row (as 2 crops + thumbnail): 48 tokens in one run."""
    return internvl_batch(model, batch_size=batch_size, tiles=3, seed=seed)


def internvl_ragged_batch(
    model: InternVLForConditionalGeneration, batch_size: int = 2, seed: int = 0
) -> Batch:
    """One image per row with 3, 1, 2, 3, 1, ... tiles: rows hold 48, 16, 32, ... visual tokens."""
    layout = [[(2, 0, 1)[r % 3] + 1] for r in range(batch_size)]
    ids, mask, pixels, _ = _internvl_rows(model, layout, seed, (3,), (5,))
    return Batch(ids, mask, pixels, [], [], 0, visual_ids=(INTERNVL_IMAGE_ID,))


def internvl_multi_image_batch(
    model: InternVLForConditionalGeneration, batch_size: int = 2, seed: int = 0
) -> Batch:
    """Two images per row, of 2 and 1 tiles (row 1: 1 and 2), two text tokens between them."""
    layout = [[2, 1] if r % 2 == 0 else [1, 2] for r in range(batch_size)]
    ids, mask, pixels, _ = _internvl_rows(model, layout, seed, (3,), (5,))
    return Batch(ids, mask, pixels, [], [], 0, visual_ids=(INTERNVL_IMAGE_ID,))


# ---- SmolVLM / Idefics3 batches ------------------------------------------------------------------------


def smolvlm_image_ids(grid: tuple[int, int], n_sub: int = SMOLVLM_SUB_TOKENS) -> list[int]:
    """The token ids that the SmolVLM processor writes for one image split into ``grid = (rows, cols)``
    sub-images, ``(0, 0)`` for an unsplit image (``get_image_prompt_string``)."""
    rows, cols = grid
    ids: list[int] = []
    for i in range(rows):
        for j in range(cols):
            ids += [SMOLVLM_FAKE_ID, SMOLVLM_ROW_COL_ID + 3 * i + j, *[SMOLVLM_IMAGE_ID] * n_sub]
        ids.append(SMOLVLM_NEWLINE_ID)
    if rows:
        ids.append(SMOLVLM_NEWLINE_ID)
    return [*ids, SMOLVLM_FAKE_ID, SMOLVLM_GLOBAL_ID, *[SMOLVLM_IMAGE_ID] * n_sub, SMOLVLM_FAKE_ID]


def _smolvlm_batch(
    model: SmolVLMForConditionalGeneration | Idefics3ForConditionalGeneration,
    grids: Sequence[Sequence[tuple[int, int]]],
    seed: int,
    text_before: Sequence[int] = (3,),
    text_after: Sequence[int] = (5,),
) -> Batch:
    """Rows ``[bos, text x a, image, (text x 2, image)..., text x b]``; ``grids[r]`` lists row ``r``'s images
    by split grid. Sets ``visual_ids`` and ``extra["pixel_attention_mask"]`` [B, max images, H, W]."""
    size = model.config.vision_config.image_size
    batch_size = len(grids)
    rows, images = [], []
    lengths = zip(row_lengths(text_before, batch_size), row_lengths(text_after, batch_size), strict=True)
    for r, (a, b) in enumerate(lengths):
        gen = row_generator(seed, r)
        row, count = [BOS_ID, *random_text(a, gen)], 0
        for i, (n_rows, n_cols) in enumerate(grids[r]):
            if i:
                row += random_text(2, gen)
            row += smolvlm_image_ids((n_rows, n_cols))
            count += n_rows * n_cols + 1
        rows.append(row + random_text(b, gen))
        images.append(torch.randn((count, 3, size, size), generator=gen))
    ids, mask, _, _ = left_pad(rows, [(0, 0)] * batch_size)
    most = max(x.shape[0] for x in images)
    pixels = torch.zeros(batch_size, most, 3, size, size)
    pixel_mask = torch.zeros(batch_size, most, size, size, dtype=torch.bool)
    for r, x in enumerate(images):
        pixels[r, : x.shape[0]] = x
        pixel_mask[r, : x.shape[0]] = True
    extra = {"pixel_attention_mask": pixel_mask}
    return Batch(ids, mask, pixels.to(model.dtype), [], [], 0, visual_ids=(SMOLVLM_IMAGE_ID,), extra=extra)


def smolvlm_batch(model, batch_size: int = 1, grid: tuple[int, int] = (2, 2), seed: int = 0) -> Batch:
    """One image per row split into ``grid`` sub-images plus the global one: 5 runs of 9 ``<image>`` tokens
    (45 per row) by default. For SmolVLM and Idefics3 models alike."""
    return _smolvlm_batch(model, [[grid]] * batch_size, seed)


def smolvlm_ragged_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """One image per row, split 2x2, unsplit, 1x3, ...: rows hold 5, 1 and 4 sub-images (45, 9, 36 tokens)."""
    grids = ((2, 2), (0, 0), (1, 3))
    return _smolvlm_batch(model, [[grids[r % 3]] for r in range(batch_size)], seed)


def smolvlm_multi_image_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """Two images per row, a 1x2 split one and an unsplit one (row 1: the other way round)."""
    grids = [[(1, 2), (0, 0)] if r % 2 == 0 else [(0, 0), (1, 2)] for r in range(batch_size)]
    return _smolvlm_batch(model, grids, seed)
