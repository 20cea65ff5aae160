"""What the tools need of each model family beyond pruning, keyed by adapter class (a family inherits
its parent's entry): the grid of an image's visual tokens and the part of the image it spans, to draw
scores over the image (``viz``, the paper's qualitative figure), and random inputs laid out as the
family's chat template lays them out, for benchmarks on models without a processor (``bench``)."""

from __future__ import annotations

from typing import Any

import torch

from priortr.adapters import (
    FamilyAdapter,
    Gemma3Adapter,
    Gemma4Adapter,
    Glm4vAdapter,
    Idefics3Adapter,
    InternVLAdapter,
    Llama4Adapter,
    LlavaAdapter,
    LlavaNextAdapter,
    MiniCPMVAdapter,
    Mistral3Adapter,
    Molmo2Adapter,
    QwenVLAdapter,
)


def visual_grid(adapter: FamilyAdapter, config, inputs: dict, row: int) -> tuple[int, int]:
    """(rows, cols) of the visual tokens of batch row ``row``'s image, which come in raster order;
    ``inputs`` are the processor's outputs for the batch."""
    return _entry(GRIDS, adapter, "token grid")(adapter, config, inputs, row)


def image_view(adapter: FamilyAdapter, image, processor):
    """The part of the PIL ``image`` that the token grid spans, as the family's processor sees it."""
    return _entry(VIEWS, adapter, "image view")(adapter, image, processor)


def dummy_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """Random model inputs with one full-size image per row and ``text_tokens`` text tokens."""
    return _entry(INPUTS, adapter, "benchmark inputs")(adapter, config, batch, text_tokens, generator)


def _entry(table: dict[type, Any], adapter: FamilyAdapter, what: str) -> Any:
    for family in type(adapter).__mro__:
        if family in table:
            return table[family]
    raise NotImplementedError(
        f"priortr has no {what} for the {adapter.name or type(adapter).__name__} family"
    )


def prompt_layout(
    image_id: int, n_visual: int, text_tokens: int, text_id_limit: int, batch: int, generator: torch.Generator
) -> torch.Tensor:
    """``[text x 4, image x N, text x (text_tokens - 4)]`` token ids, [B, text_tokens + N]; the first
    text token after the image is the separator."""
    if text_tokens < 6:
        raise ValueError(f"a benchmark prompt needs at least 6 text tokens; got {text_tokens}")
    text = torch.randint(100, text_id_limit, (batch, text_tokens), generator=generator)
    image = torch.full((batch, n_visual), image_id)
    return torch.cat([text[:, :4], image, text[:, 4:]], dim=1)


def _one_image_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """Random model inputs with one full-size image per row and ``text_tokens`` text tokens, laid out
    as the family's chat template does, for benchmarks on models without a processor."""
    vision = config.vision_config
    n_visual = config.image_seq_length
    image_id = config.image_token_id
    ids = prompt_layout(image_id, n_visual, text_tokens, image_id - 1, batch, generator)
    pixels = torch.randn(batch, 3, vision.image_size, vision.image_size, generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def _clip_grid(adapter: FamilyAdapter, config, inputs: dict, row: int) -> tuple[int, int]:
    """A square grid of CLIP patches, side ``image_size // patch_size`` (24 x 24 for LLaVA-1.5 at 336 px);
    ``vision_feature_select_strategy='full'`` would add the CLS token and has no grid."""
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    n_visual = getattr(config, "image_seq_length", side * side)
    if n_visual != side * side:
        raise ValueError(
            f"{n_visual} visual tokens per image are not the {side}x{side} patch grid (a CLS token is "
            "kept with vision_feature_select_strategy='full'); cannot map tokens to image regions"
        )
    return side, side


def _clip_view(adapter: FamilyAdapter, image, processor):
    """The crop of ``image`` that CLIP preprocessing keeps, at the original's resolution.

    The processor pads to a square first if ``do_pad``, resizes the shortest edge to ``size`` (or to
    ``height`` x ``width``) and centre-crops ``crop_size``; only the pad and the crop change what the
    patch grid spans.
    """
    ip = getattr(processor, "image_processor", processor)
    if getattr(ip, "do_pad", False):
        image = _pad_to_square(image, getattr(ip, "image_mean", None))
    if not getattr(ip, "do_center_crop", False):
        return image
    width, height = image.size
    new_h, new_w = _resized_size(ip, height, width)
    crop_h, crop_w = min(ip.crop_size.get("height"), new_h), min(ip.crop_size.get("width"), new_w)
    top, left = (new_h - crop_h) // 2, (new_w - crop_w) // 2
    sx, sy = width / new_w, height / new_h
    box = (left * sx, top * sy, (left + crop_w) * sx, (top + crop_h) * sy)
    return image.crop(tuple(round(v) for v in box))


def _resized_size(ip, height: int, width: int) -> tuple[int, int]:
    """(height, width) after the processor's resize, as transformers' ``get_resize_output_image_size``."""
    size = ip.size if getattr(ip, "do_resize", True) else {}
    if size.get("height") and size.get("width"):
        return size.get("height"), size.get("width")
    short_side = size.get("shortest_edge")
    if not short_side:
        return height, width
    if width <= height:
        return int(short_side * height / width), short_side
    return short_side, int(short_side * width / height)


def _pad_to_square(image, mean):
    """``image`` centred on a square of its longest side, filled with the processor's mean colour."""
    from PIL import Image

    width, height = image.size
    side = max(width, height)
    if width == height:
        return image
    fill = tuple(int(m * 255) for m in mean) if mean is not None else 0
    square = Image.new(image.mode, (side, side), fill if image.mode == "RGB" else 0)
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


def _qwen_grid(adapter: QwenVLAdapter, config, inputs: dict, row: int) -> tuple[int, int]:
    """The adapter's grid of ``inputs["image_grid_thw"][row]`` (one image per prompt, so the row's
    image)."""
    grid = inputs.get("image_grid_thw")
    if grid is None:
        raise ValueError("the inputs hold no image_grid_thw, so the image's token grid is unknown")
    return adapter.image_grid(config, grid[row])


def _whole_image(adapter: FamilyAdapter, image, processor):
    """The whole image: Qwen's ``smart_resize`` (to a multiple of 28 px) and the Pixtral processor (to a
    multiple of the patch size) keep the aspect ratio and crop nothing, so the grid spans the whole image."""
    return image


def _qwen_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """A 672x672 image: a 48x48 patch grid merged 2x2 into 576 tokens, as LLaVA-1.5's budget scale."""
    start, end = config.vision_start_token_id, config.vision_end_token_id
    return _merged_grid_inputs(config, batch, text_tokens, generator, (start, end), start)


def _merged_grid_inputs(
    config, batch: int, text_tokens: int, generator: torch.Generator, markers: tuple[int, int], limit: int
) -> dict:
    """One 48x48 patch grid per row, merged by the tower, between the image's ``markers``; text ids
    below ``limit``."""
    vision = config.vision_config
    grid = (1, 48, 48)
    n_visual = grid[1] * grid[2] // vision.spatial_merge_size**2
    ids = prompt_layout(config.image_token_id, n_visual, text_tokens, limit, batch, generator)
    ids = _bracketed(ids, n_visual, *markers)
    frames = getattr(vision, "temporal_patch_size", 1)  # LLaVA-OneVision-1.5's tower: one frame per patch
    patch = vision.in_channels * frames * vision.patch_size**2
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(batch * grid[1] * grid[2], patch, generator=generator),
        "image_grid_thw": torch.tensor([grid] * batch),
        "mm_token_type_ids": (ids == config.image_token_id).long(),
    }


def _bracketed(ids: torch.Tensor, n_visual: int, start: int, end: int) -> torch.Tensor:
    """``prompt_layout``'s ids with the text tokens on either side of the image made its ``start`` and
    ``end`` markers."""
    first = ids.new_full((ids.shape[0], 1), start)
    last = ids.new_full((ids.shape[0], 1), end)
    return torch.cat([ids[:, :3], first, ids[:, 4 : 4 + n_visual], last, ids[:, 5 + n_visual :]], dim=1)


def _pixtral_grid(adapter: Mistral3Adapter, config, inputs: dict, row: int) -> tuple[int, int]:
    """The adapter's grid of an image of ``image_sizes[row]`` pixels (one image per prompt, so the
    row's image); tokens come in raster order."""
    sizes = inputs.get("image_sizes")
    if sizes is None:
        raise ValueError("the inputs hold no image_sizes, so the image's token grid is unknown")
    height, width = (int(v) for v in sizes[row])
    return adapter.pixel_grid(config, height, width)


def _pixtral_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """A square image of up to 24 x 24 visual tokens (576, LLaVA-1.5's budget scale: 672 px for
    Mistral Small 3.1's 14 px patches), as large as the tower's ``image_size`` allows, with its row
    breaks and end marker (stand-in ids just below ``[IMG]``)."""
    vision = config.vision_config
    pixels = vision.patch_size * config.spatial_merge_size
    side = min(24, vision.image_size // pixels)
    image_id = config.image_token_id
    ids = prompt_layout(image_id, side * side, text_tokens, image_id - 2, batch, generator)
    rows = [token for _ in range(side) for token in [*[image_id] * side, image_id - 1]]
    image = torch.tensor([*rows[:-1], image_id - 2])
    ids = torch.cat([ids[:, :4], image.expand(batch, -1), ids[:, 4 + side * side :]], dim=1)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(batch, 3, side * pixels, side * pixels, generator=generator),
        "image_sizes": torch.tensor([[side * pixels] * 2] * batch),
    }


def _internvl_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """A 640x427 photo as the InternVL processor tiles it (448 px tiles, ``max_patches=12``): a 3x2 crop
    grid plus the thumbnail, 7 tiles of ``image_seq_length`` tokens (1792 at 256 per tile)."""
    tiles = 7
    height, width = config.vision_config.image_size
    image_id = config.image_token_id
    n_visual = tiles * config.image_seq_length
    ids = prompt_layout(image_id, n_visual, text_tokens, image_id - 2, batch, generator)
    ids = _bracketed(ids, n_visual, image_id - 2, image_id - 1)  # stand-ins for <img> and </img>
    pixels = torch.randn(batch * tiles, 3, height, width, generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def _glm_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """A 672x672 image: a 48x48 patch grid merged 2x2 into 576 tokens, as LLaVA-1.5's budget scale,
    between ``<|begin_of_image|>`` and ``<|end_of_image|>``."""
    markers = (config.image_start_token_id, config.image_end_token_id)
    limit = min(*markers, config.video_start_token_id)
    return _merged_grid_inputs(config, batch, text_tokens, generator, markers, limit)


def _anyres_image_size(config) -> tuple[int, int]:
    """The largest pinpoint of at most 2x2 tiles (squares first): 672 x 672 for LLaVA-NeXT, its
    largest input (576 + 48 x 48 + 48 = 2928 tokens), 768 x 768 for OneVision (3699 tokens)."""
    size = config.vision_config.image_size

    def fits(pinpoint: list[int]) -> bool:
        return (pinpoint[0] // size) * (pinpoint[1] // size) <= 4

    height, width = max(
        filter(fits, config.image_grid_pinpoints), key=lambda p: (p[0] * p[1], -abs(p[0] - p[1]))
    )
    return height, width


def _anyres_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """One ``_anyres_image_size`` image per row, with its real AnyRes token count and crop stack."""
    height, width = _anyres_image_size(config)
    n_visual = adapter.anyres_tokens(config, height, width)
    limit = min(adapter.visual_token_ids(config).values())
    ids = prompt_layout(config.image_token_id, n_visual, text_tokens, limit, batch, generator)
    size = config.vision_config.image_size
    crops = adapter.anyres_crops(config, height, width)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(batch, crops, 3, size, size, generator=generator),
        "image_sizes": torch.tensor([[height, width]] * batch),
    }


def _idefics3_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """A 640x427 photo as the processors split it: resized to the longest edge of 4 sub-images, a 3x4
    grid plus the global image, 13 sub-images (1053 tokens for SmolVLM2-2.2B, 832 for SmolVLM-256M).

    The ``text_tokens`` text tokens come on top of the image's 32 markers, whose ids are stand-ins just
    below ``<image>``: ``<fake>`` right under it, then newline and the tags."""
    if text_tokens < 6:
        raise ValueError(f"a benchmark prompt needs at least 6 text tokens; got {text_tokens}")
    rows, cols = 3, 4
    vision = config.vision_config
    n_sub = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
    image_id = config.image_token_id
    fake, global_tag, newline = image_id - 1, image_id - 2, image_id - 3
    image: list[int] = []
    for i in range(rows):
        for j in range(cols):
            image += [fake, global_tag - 1 - (cols * i + j), *[image_id] * n_sub]
        image.append(newline)
    image += [newline, fake, global_tag, *[image_id] * n_sub, fake]
    text = torch.randint(100, global_tag - 1 - rows * cols, (batch, text_tokens), generator=generator)
    ids = torch.cat([text[:, :4], torch.tensor(image).expand(batch, -1), text[:, 4:]], dim=1)
    size = vision.image_size
    n_images = rows * cols + 1
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(batch, n_images, 3, size, size, generator=generator),
        "pixel_attention_mask": torch.ones(batch, n_images, size, size, dtype=torch.bool),
    }


def _gemma3_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """One image per row, ``mm_tokens_per_image`` tokens (256 as released) between
    ``<start_of_image>`` and ``<end_of_image>``, with the processor's ``token_type_ids``."""
    n_visual = config.mm_tokens_per_image
    image_id = config.image_token_id
    limit = min(image_id, config.boi_token_index, config.eoi_token_index)
    ids = prompt_layout(image_id, n_visual, text_tokens, limit, batch, generator)
    ids = _bracketed(ids, n_visual, config.boi_token_index, config.eoi_token_index)
    size = config.vision_config.image_size
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(batch, 3, size, size, generator=generator),
        "token_type_ids": (ids == image_id).long(),
    }


GEMMA4_GRID = (14, 20)
"""The pooled token grid of the benchmark's Gemma 4 image: 280 tokens, ``Gemma4Processor``'s default
``max_soft_tokens`` (the caller picks 70-1120)."""


def _gemma4_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """One image per row, ``GEMMA4_GRID`` tokens between ``<|image>`` and ``<image|>``, each pooled from
    ``pooling_kernel_size`` x ``pooling_kernel_size`` patches, passed as the processor passes them
    (flattened patches and their (x, y)), with its ``mm_token_type_ids``."""
    vision = config.vision_config
    rows, columns = (side * vision.pooling_kernel_size for side in GEMMA4_GRID)
    n_visual = GEMMA4_GRID[0] * GEMMA4_GRID[1]
    image_id = config.image_token_id
    limit = min(image_id, config.video_token_id, config.boi_token_id, config.eoi_token_id)
    ids = prompt_layout(image_id, n_visual, text_tokens, limit, batch, generator)
    ids = _bracketed(ids, n_visual, config.boi_token_id, config.eoi_token_id)
    patch = torch.arange(rows * columns)
    positions = torch.stack([patch % columns, patch // columns], dim=1)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.rand(batch, rows * columns, 3 * vision.patch_size**2, generator=generator),
        "image_position_ids": positions.expand(batch, -1, -1).clone(),
        "mm_token_type_ids": (ids == image_id).long(),
    }


def _llama4_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """One image of 2 x 2 tiles and its global view per row (``Llama4Processor`` on a 672 px square
    image with Scout's 336 px tiles: 5 x 144 = 720 visual tokens), with stand-in ids for the tile
    separators and ``<|image|>`` just below the others."""
    vision = config.vision_config
    n_tile = int((vision.image_size // vision.patch_size) ** 2 * vision.pixel_shuffle_ratio**2)
    patch, start, end = config.image_token_id, config.boi_token_index, config.eoi_token_index
    tile_x, tile_y, whole = (min(patch, start, end) - k for k in (1, 2, 3))
    tiles = [patch] * n_tile
    row = [*tiles, tile_x, *tiles, tile_y]
    image = torch.tensor([start, *row, *row, whole, *tiles, end])
    text = torch.randint(100, whole, (batch, text_tokens), generator=generator)
    ids = torch.cat([text[:, :3], image.expand(batch, -1), text[:, 3:]], dim=1)
    pixels = torch.randn(batch * 5, 3, vision.image_size, vision.image_size, generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


MINICPMV_MARKERS = ("image_start_id", "image_end_id", "slice_start_id", "slice_end_id", "newline_id")
"""The config fields of MiniCPM-V's markers (4.7 names them for its canvas M-RoPE; 4.6 does not)."""


def _minicpmv_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """One image per row as ``MiniCPMV4_6Processor`` writes a sliced one: its global view and 2 x 2
    slices, every view a full square of the tower's position table (``image_size / patch_size`` patches a
    side: 448 / 14 gives 1024 patches, 64 tokens in the default 16x mode, 320 for the image), NaViT-packed.
    The markers (``<image>``, ``</image>``, ``<slice>``, ``</slice>`` and the newline between rows of
    slices) are the config's ids where it names them (4.7, with the processor's ``mm_token_type_ids``),
    else stand-ins just below the placeholders."""
    if text_tokens < 6:
        raise ValueError(f"a benchmark prompt needs at least 6 text tokens; got {text_tokens}")
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    n_view = side * side // 16
    image_id = config.image_token_id
    top = min(image_id, config.video_token_id or image_id)
    named = [getattr(config, field, None) for field in MINICPMV_MARKERS]
    markers = named if None not in named else [top - k for k in range(1, 6)]
    start, end, slice_start, slice_end, newline = markers
    image = [start, *[image_id] * n_view, end]
    for row in range(2):
        image += [newline] * (row > 0) + [slice_start, *[image_id] * n_view, slice_end] * 2
    text = torch.randint(100, min(top, *markers), (batch, text_tokens), generator=generator)
    ids = torch.cat([text[:, :4], torch.tensor(image).expand(batch, -1), text[:, 4:]], dim=1)
    views = 5 * batch
    pixels = torch.randn(
        1, 3, vision.patch_size, views * side * side * vision.patch_size, generator=generator
    )
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": pixels,
        "target_sizes": torch.tensor([[side, side]] * views, dtype=torch.int32),
    }
    if None not in named:
        inputs["mm_token_type_ids"] = (ids == image_id).long()
    return inputs


def _molmo2_inputs(
    adapter: FamilyAdapter, config, batch: int, text_tokens: int, generator: torch.Generator
) -> dict:
    """One image per row as ``Molmo2Processor`` writes it, from 5 crops of ``s x s`` patches (27 x 27 at
    378 px and 14 px patches): the global crop's low-resolution view of ``h x h`` tokens, ``h = ceil(s /
    2)``, then the 2 x 2 other crops' high-resolution view of ``2h x 2h`` tokens (980 tokens as released),
    each token pooling a 2 x 2 window of its crop's patches; every row closed by a stand-in for ``<im_col>``
    (the config names no id for it: the id after ``<im_patch>``), with the processor's
    ``mm_token_type_ids``."""
    if text_tokens < 6:
        raise ValueError(f"a benchmark prompt needs at least 6 text tokens; got {text_tokens}")
    vision = config.vision_config
    side = vision.image_size[0] // vision.patch_size
    low = -(-side // 2)
    patch, column = config.image_patch_id, config.image_patch_id + 1

    def window(crop: int, row: int, col: int) -> list[int]:
        cells = [(2 * row + dr, 2 * col + dc) for dr in (0, 1) for dc in (0, 1)]
        return [crop * side * side + r * side + c if r < side and c < side else -1 for r, c in cells]

    pooling = [window(0, r, c) for r in range(low) for c in range(low)]
    pooling += [
        window(1 + 2 * (r // low) + c // low, r % low, c % low)
        for r in range(2 * low)
        for c in range(2 * low)
    ]
    image = [
        config.low_res_image_start_token_id,
        *([patch] * low + [column]) * low,
        config.image_end_token_id,
    ]
    image += [
        config.image_start_token_id,
        *([patch] * 2 * low + [column]) * 2 * low,
        config.image_end_token_id,
    ]
    text = torch.randint(100, config.text_config.vocab_size, (batch, text_tokens), generator=generator)
    ids = torch.cat([text[:, :4], torch.tensor(image).expand(batch, -1), text[:, 4:]], dim=1)
    pixels = torch.randn(
        batch * 5, side * side, vision.patch_size**2 * vision.num_channels, generator=generator
    )
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": pixels,
        "image_grids": torch.tensor([[low, low, 2 * low, 2 * low]] * batch),
        "image_token_pooling": torch.tensor(pooling * batch),
        "image_num_crops": torch.full((batch,), 5),
        # 1 on the image tokens: the markers, the patches and the columns, all past the LM head's vocabulary
        "mm_token_type_ids": (ids >= config.text_config.vocab_size).long(),
    }


GRIDS = {LlavaAdapter: _clip_grid, QwenVLAdapter: _qwen_grid, Mistral3Adapter: _pixtral_grid}
VIEWS = {LlavaAdapter: _clip_view, QwenVLAdapter: _whole_image, Mistral3Adapter: _whole_image}
INPUTS = {
    FamilyAdapter: _one_image_inputs,
    QwenVLAdapter: _qwen_inputs,
    Glm4vAdapter: _glm_inputs,
    Mistral3Adapter: _pixtral_inputs,
    InternVLAdapter: _internvl_inputs,
    LlavaNextAdapter: _anyres_inputs,
    Idefics3Adapter: _idefics3_inputs,
    Gemma3Adapter: _gemma3_inputs,
    Llama4Adapter: _llama4_inputs,
    Gemma4Adapter: _gemma4_inputs,
    MiniCPMVAdapter: _minicpmv_inputs,
    Molmo2Adapter: _molmo2_inputs,
}
