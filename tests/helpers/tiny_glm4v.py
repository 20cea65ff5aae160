"""A tiny GLM-4.1V and batches laid out as ``Glm4vProcessor`` writes prompts.

* image: ``<|begin_of_image|> <|image|> x (h*w/4) <|end_of_image|>`` (the chat template writes
  ``<|begin_of_image|><|image|><|end_of_image|>`` and the processor expands ``<|image|>``);
* video of ``t`` temporal patches: ``<|begin_of_video|>``, then per frame ``<|begin_of_image|> <|image|> x
  (h*w/4) <|end_of_image|> <timestamp>`` (``Glm4vProcessor.replace_frame_token_id``; a few text tokens
  here), then ``<|end_of_video|>``. Video frames use the image placeholder id; ``mm_token_type_ids`` says
  which are video (2) and which image (1) tokens.

Positions are 3-D RoPE ids from ``get_rope_index`` (temporal, height, width), like Qwen2-VL's M-RoPE; the
text model's rotary embedding is interleaved (``rotate_half_llm``) over half of each head
(``partial_rotary_factor`` 0.5).

Same conventions as ``tests.helpers.tiny``: special ids at the top of the vocabulary, random text from
``[TEXT_LO, TEXT_HI)``, left padding, row ``r`` depends only on ``(seed, r)``.
"""

from __future__ import annotations

import torch
from transformers import Glm4vConfig, Glm4vForConditionalGeneration

from tests.helpers.tiny import (
    PAD_ID,
    TEXT_CONFIG,
    Batch,
    finish_model,
    random_text,
    row_generator,
    row_lengths,
)

GLM_IMAGE_ID, GLM_VIDEO_ID = 199, 198
GLM_IMAGE_START_ID, GLM_IMAGE_END_ID, GLM_VIDEO_START_ID, GLM_VIDEO_END_ID = 197, 196, 195, 194
TIMESTAMP_TOKENS = 2  # stands for the frame's timestamp text after its <|end_of_image|>

# head_dim 16, half of it rotary: 4 frequencies, split 1 (temporal) + 1 (height) + 2 (width).
_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [1, 1, 2],
    "partial_rotary_factor": 0.5,
}
_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "image_size": 56,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": TEXT_CONFIG["hidden_size"],
}


def tiny_glm4v(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> Glm4vForConditionalGeneration:
    """A 4-layer GLM-4 text model + 2-block GLM-4V vision tower (patch 14, 2x2 merge, 2 frames per patch)."""
    text = {key: value for key, value in TEXT_CONFIG.items() if key not in ("bos_token_id", "eos_token_id")}
    config = Glm4vConfig(
        text_config={**text, "rope_parameters": _ROPE},
        vision_config=_VISION,
        image_token_id=GLM_IMAGE_ID,
        video_token_id=GLM_VIDEO_ID,
        image_start_token_id=GLM_IMAGE_START_ID,
        image_end_token_id=GLM_IMAGE_END_ID,
        video_start_token_id=GLM_VIDEO_START_ID,
        video_end_token_id=GLM_VIDEO_END_ID,
        pad_token_id=PAD_ID,
    )
    config.text_config.eos_token_id = TEXT_CONFIG["eos_token_id"]
    torch.manual_seed(seed)
    model = Glm4vForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    return finish_model(model, attn)


def _image(grid: tuple[int, int, int]) -> list[int]:
    t, h, w = grid
    return [GLM_IMAGE_START_ID, *[GLM_IMAGE_ID] * (t * h * w // 4), GLM_IMAGE_END_ID]


def _video(grid: tuple[int, int, int], gen: torch.Generator) -> list[int]:
    t, h, w = grid
    frames = [token for _ in range(t) for token in [*_image((1, h, w)), *random_text(TIMESTAMP_TOKENS, gen)]]
    return [GLM_VIDEO_START_ID, *frames, GLM_VIDEO_END_ID]


def glm4v_segments_batch(model, rows: list[list[tuple[str, object]]], seed: int = 0) -> Batch:
    """Left-padded rows of segments ``("text", n)``, ``("image", (t, h, w))``, ``("video", (t, h, w))``,
    pixels in prompt order (as the model scatters them into the placeholders)."""
    vision = model.config.vision_config
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    token_rows, types, grids = [], [], {"image": [], "video": []}
    pixels: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
    for r, segments in enumerate(rows):
        gen = row_generator(seed, r)
        tokens: list[int] = []
        kinds: list[int] = []
        for kind, spec in segments:
            if kind == "text":
                part = random_text(spec, gen)
            else:
                part = _image(spec) if kind == "image" else _video(spec, gen)
                grids[kind].append(spec)
                pixels[kind].append(torch.randn((spec[0] * spec[1] * spec[2], patch_dim), generator=gen))
            tokens += part
            code = {"text": 0, "image": 1, "video": 2}[kind]
            kinds += [code if token == GLM_IMAGE_ID else 0 for token in part]
        token_rows.append(tokens)
        types.append(kinds)
    seq_len = max(len(tokens) for tokens in token_rows)
    ids = torch.full((len(rows), seq_len), PAD_ID, dtype=torch.long)
    mm_types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for r, tokens in enumerate(token_rows):
        ids[r, seq_len - len(tokens) :] = torch.tensor(tokens)
        mm_types[r, seq_len - len(tokens) :] = torch.tensor(types[r])
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
        mm_token_type_ids=mm_types,
        visual_ids=(GLM_IMAGE_ID,),
        extra=extra,
    )


def _text_lengths(batch_size: int) -> list[tuple[int, int]]:
    return list(zip(row_lengths((3,), batch_size), row_lengths((5,), batch_size), strict=True))


def glm4v_batch(model, batch_size: int = 1, grid: tuple[int, int, int] = (1, 6, 8), seed: int = 0) -> Batch:
    """One image per row, ``grid`` patches (12 tokens by default) in every row."""
    rows = [[("text", a), ("image", grid), ("text", b)] for a, b in _text_lengths(batch_size)]
    return glm4v_segments_batch(model, rows, seed)


RAGGED_GRIDS = ((1, 4, 4), (1, 6, 8))  # 4 and 12 tokens


def glm4v_ragged_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    rows = [
        [("text", a), ("image", RAGGED_GRIDS[r % 2]), ("text", b)]
        for r, (a, b) in enumerate(_text_lengths(batch_size))
    ]
    return glm4v_segments_batch(model, rows, seed)


def glm4v_video_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """One video per row: 2 temporal patches of 4 tokens, each written as a frame of its own (one item)."""
    rows = [[("text", a), ("video", (2, 4, 4)), ("text", b)] for a, b in _text_lengths(batch_size)]
    return glm4v_segments_batch(model, rows, seed)


def glm4v_multi_image_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    rows = [
        [("text", a), ("image", (1, 4, 4)), ("text", 2), ("image", (1, 6, 8)), ("text", b)]
        for a, b in _text_lengths(batch_size)
    ]
    return glm4v_segments_batch(model, rows, seed)
