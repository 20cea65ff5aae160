"""Tiny MiniCPM-V 4.6 models and batches laid out as ``MiniCPMV4_6Processor`` writes prompts.

An image is its global view then, when it is sliced, ``rows x cols`` slices, one line per row of slices
(``MiniCPMV4_6Processor.replace_image_token``)::

    <image> <unk> x n0 </image> <slice> <unk> x n1 </slice> <slice> <unk> x n2 </slice> \\n <slice> ...

``<unk>`` being the placeholder (``config.image_token_id``). A view of ``h x w`` patches becomes
``h * w / 16`` tokens in the default ``downsample_mode="16x"`` (the ViT's window merger, then the
merger's 2x2) and ``h * w / 4`` in ``"4x"`` (the merger only), so N is read from the placeholders.
``pixel_values`` are NaViT-packed ``[1, 3, patch, sum(h * w) * patch]`` for the whole batch, every
view's patches in prompt order, and ``target_sizes`` [views, 2] their patch grids. The decoder is
Qwen3.5's hybrid one (``tests.helpers.tiny_qwen3_5``: layers 1 and 3 full attention) with plain
``[B, S]`` position ids.

Same conventions as ``tests.helpers.tiny``: special ids at the top of the vocabulary, random text from
``[TEXT_LO, TEXT_HI)``, left padding, row ``r`` depends only on ``(seed, r)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import transformers

from tests.helpers.tiny import BOS_ID, PAD_ID, Batch, finish_model, left_pad, random_text, row_generator
from tests.helpers.tiny_qwen3_5 import _text_config

# The placeholder, <image>, </image>, <slice>, </slice> and "\n" (special here so that random text never
# forms it); the video placeholder.
MINICPMV_IMAGE_ID, IMAGE_START_ID, IMAGE_END_ID, SLICE_START_ID, SLICE_END_ID, NEWLINE_ID = range(
    199, 193, -1
)
MINICPMV_VIDEO_ID = 193
PATCH = 2
VIEW = (8, 8)  # patches of every view (global and slices): 4 tokens at 16x, 16 at 4x


def tiny_minicpmv4_6(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0, version: str = "4_6"
):
    """A 4-layer Qwen3.5 decoder (linear, full, linear, full) and a 2-layer SigLIP-style tower (patch 2,
    the window merger after layer 0, 16 x 16 position table); ``version="4_7"`` builds MiniCPM-V 4.7 (canvas
    M-RoPE, which needs the markers' ids). Skips, naming the release, where transformers lacks the class
    (4.6 came in 5.17, the floor; 4.7 after it)."""
    name = f"MiniCPMV{version}ForConditionalGeneration"
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    markers = {
        "image_start_id": IMAGE_START_ID,
        "image_end_id": IMAGE_END_ID,
        "slice_start_id": SLICE_START_ID,
        "slice_end_id": SLICE_END_ID,
        "newline_id": NEWLINE_ID,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 16 * PATCH,
        "patch_size": PATCH,
    }
    config = getattr(transformers, f"MiniCPMV{version}Config")(
        text_config={"model_type": "qwen3_5_text", **_text_config()},  # 5.17 reads the type off the dict
        vision_config=vision,
        insert_layer_id=0,
        image_token_id=MINICPMV_IMAGE_ID,
        video_token_id=MINICPMV_VIDEO_ID,
        pad_token_id=PAD_ID,
        **(markers if version == "4_7" else {}),
    )
    torch.manual_seed(seed)
    model = getattr(transformers, name)._from_config(config, attn_implementation=attn, dtype=dtype)
    return finish_model(model, attn)


def tiny_minicpmv4_7(dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0):
    """``tiny_minicpmv4_6``'s sizes as MiniCPM-V 4.7."""
    return tiny_minicpmv4_6(dtype, attn, seed, version="4_7")


def view_tokens(view: tuple[int, int] = VIEW, mode: str = "16x") -> int:
    """Visual tokens of one view of ``view`` patches in ``downsample_mode`` ``mode``."""
    return view[0] * view[1] // (4 if mode == "4x" else 16)


def minicpmv_image_ids(grid: tuple[int, int], n: int) -> list[int]:
    """The ids the processor writes for one image of ``grid = (rows, cols)`` slices (``(0, 0)``: the
    global view alone), ``n`` tokens per view."""
    rows, cols = grid
    ids = [IMAGE_START_ID, *[MINICPMV_IMAGE_ID] * n, IMAGE_END_ID]
    for i in range(rows):
        if i:
            ids.append(NEWLINE_ID)
        for _ in range(cols):
            ids += [SLICE_START_ID, *[MINICPMV_IMAGE_ID] * n, SLICE_END_ID]
    return ids


def _minicpmv_batch(
    model, grids: Sequence[Sequence[tuple[int, int]]], seed: int, mode: str | None = None
) -> Batch:
    """Rows ``[bos, text x a, image, (text x 2, image)..., text x b]`` (a = 3, 5, ..., b = 5, 7, ...);
    ``grids[r]`` lists row ``r``'s images by slice grid. ``mode`` passes ``downsample_mode``. Sets
    ``row_inputs``: each row's patches are a slice of the batch's packed ``pixel_values``; for MiniCPM-V
    4.7, ``mm_token_type_ids`` (1 on the placeholders), which its canvas M-RoPE needs."""
    n = view_tokens(mode=mode or model.config.downsample_mode)
    typed = model.config.model_type == "minicpmv4_7"  # canvas M-RoPE reads the placeholders' types
    side = VIEW[0] * VIEW[1] * PATCH
    rows, row_inputs = [], []
    for r, images in enumerate(grids):
        gen = row_generator(seed, r)
        row, views = [BOS_ID, *random_text(3 + 2 * r, gen)], 0
        for i, grid in enumerate(images):
            if i:
                row += random_text(2, gen)
            row += minicpmv_image_ids(grid, n)
            views += 1 + grid[0] * grid[1]
        rows.append(row + random_text(5 + 2 * r, gen))
        inputs = {
            "input_ids": torch.tensor([rows[-1]]),
            "attention_mask": torch.ones(1, len(rows[-1]), dtype=torch.long),
            "pixel_values": torch.randn((1, 3, PATCH, views * side), generator=gen).to(model.dtype),
            "target_sizes": torch.tensor([VIEW] * views, dtype=torch.int32),
        }
        if typed:
            inputs["mm_token_type_ids"] = (inputs["input_ids"] == MINICPMV_IMAGE_ID).long()
        row_inputs.append(inputs if mode is None else {**inputs, "downsample_mode": mode})
    ids, mask, _, _ = left_pad(rows, [(0, 0)] * len(rows))
    extra = {"target_sizes": torch.cat([inputs["target_sizes"] for inputs in row_inputs])}
    if mode is not None:
        extra["downsample_mode"] = mode
    pixel_values = torch.cat([inputs["pixel_values"] for inputs in row_inputs], dim=-1)
    return Batch(
        ids,
        mask,
        pixel_values,
        [],
        [],
        0,
        mm_token_type_ids=(ids == MINICPMV_IMAGE_ID).long() if typed else None,
        visual_ids=(MINICPMV_IMAGE_ID,),
        extra=extra,
        row_inputs=row_inputs,
    )


def minicpmv_batch(model, batch_size: int = 1, seed: int = 0) -> Batch:
    """One image per row, its global view and 2 x 2 slices: 5 runs of 4 tokens (20 per row)."""
    return _minicpmv_batch(model, [[(2, 2)]] * batch_size, seed)


def minicpmv_ragged_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """One image per row, sliced 2 x 2, unsliced, 1 x 3, ...: 20, 4 and 16 tokens."""
    grids = ((2, 2), (0, 0), (1, 3))
    return _minicpmv_batch(model, [[grids[r % 3]] for r in range(batch_size)], seed)


def minicpmv_multi_image_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """Two images per row, a 1 x 2 sliced one and an unsliced one (row 1: the other way round)."""
    grids = [[(1, 2), (0, 0)] if r % 2 == 0 else [(0, 0), (1, 2)] for r in range(batch_size)]
    return _minicpmv_batch(model, grids, seed)


def minicpmv_4x_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """``minicpmv_batch`` with ``downsample_mode="4x"`` passed at call time: 5 runs of 16 tokens (80)."""
    return _minicpmv_batch(model, [[(2, 2)]] * batch_size, seed, mode="4x")
