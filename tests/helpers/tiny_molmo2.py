"""Tiny Molmo2 models and batches laid out as ``Molmo2Processor.replace_image_token`` writes an image: its
low-resolution global view, then its high-resolution crops, each view a grid of ``<im_patch>`` rows
closed by ``<im_col>``::

    <low_res_im_start> (<im_patch> x w <im_col>) x h <im_end>
    <im_start> (<im_patch> x W <im_col>) x H <im_end>

with ``mm_token_type_ids`` 1 on all of these (the processor's ``image_token_ids``), which makes every
image token of a row one bidirectional block at prefill. The special ids sit past the LM head's
vocabulary (``vocab_size`` 200, 8 additional embeddings), as the released checkpoints' do.

Inputs per image (``Molmo2ImageProcessor``): ``pixel_values`` [crops, patches, 3 * patch**2] (crop 0 the
global view), ``image_grids`` (h, w, H, W), ``image_token_pooling`` [h * w + H * W, 4] (the patch indices
each token pools, into that image's crops) and ``image_num_crops``. Here every image has 2 crops of 4 x 4
patches; its global view is 2 x 2 tokens pooled from crop 0, its high-resolution view ``H x W`` tokens
(3 x 3 by default) from crop 1, each token a 2 x 2 window of patches.

Same conventions as ``tests.helpers.tiny``: random text from ``[TEXT_LO, TEXT_HI)``, left padding, row
``r`` depends only on ``(seed, r)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import transformers

from tests.helpers.tiny import BOS_ID, PAD_ID, TEXT_CONFIG, Batch, left_pad, random_text, row_generator

# Past the LM head's 200 ids: <im_start>, <im_end>, <im_patch>, <im_col>, <low_res_im_start>, <frame_start>,
# <frame_end>.
IM_START_ID, IM_END_ID, IM_PATCH_ID, IM_COL_ID, LOW_RES_START_ID, FRAME_START_ID, FRAME_END_ID = range(
    200, 207
)
IMAGE_TOKEN_IDS = (
    IM_START_ID,
    IM_END_ID,
    IM_PATCH_ID,
    IM_COL_ID,
    LOW_RES_START_ID,
    FRAME_START_ID,
    FRAME_END_ID,
)
PATCH, SIDE = 2, 4  # 4 x 4 patches of 2 px per crop
LOW_RES = (2, 2)


def tiny_molmo2(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0, qk_norm: str = "qwen3"
):
    """A 4-layer Molmo2 text model (Qwen3-style per-head q/k norms, or OLMo's over the whole projection
    with ``qk_norm="olmo"``) and a 2-layer ViT whose last layer the pooling adapter reads. Skips where
    transformers has no Molmo2 (it came after 5.17, the floor)."""
    if not hasattr(transformers, "Molmo2ForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Molmo2ForConditionalGeneration")
    text = {**TEXT_CONFIG, "head_dim": 16, "additional_vocab_size": 8, "qk_norm_type": qk_norm}
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "image_size": [SIDE * PATCH, SIDE * PATCH],
        "patch_size": PATCH,
    }
    adapter = {
        "vision_feature_layer": [-1],
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 64,
        "text_hidden_size": TEXT_CONFIG["hidden_size"],
    }
    config = transformers.Molmo2Config(
        text_config=text,
        vision_config=vision,
        adapter_config=adapter,
        image_start_token_id=IM_START_ID,
        low_res_image_start_token_id=LOW_RES_START_ID,
        image_end_token_id=IM_END_ID,
        image_patch_id=IM_PATCH_ID,
        frame_start_token_id=FRAME_START_ID,
        frame_end_token_id=FRAME_END_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = transformers.Molmo2ForConditionalGeneration._from_config(
        config, attn_implementation=attn, dtype=dtype
    )
    model.eval()
    assert model.config.text_config._attn_implementation == attn
    return model


def view_ids(start: int, grid: tuple[int, int]) -> list[int]:
    """One view: ``start``, ``grid`` rows of ``<im_patch>`` each closed by ``<im_col>``, ``<im_end>``."""
    rows, cols = grid
    return [start, *([IM_PATCH_ID] * cols + [IM_COL_ID]) * rows, IM_END_ID]


def molmo2_image_ids(high: tuple[int, int]) -> list[int]:
    """The ids the processor writes for one image whose high-resolution view is ``high`` tokens."""
    return view_ids(LOW_RES_START_ID, LOW_RES) + view_ids(IM_START_ID, high)


def _pooling(grid: tuple[int, int], crop: int, stride: int) -> list[list[int]]:
    """Each token of ``grid`` pools a 2 x 2 window of crop ``crop``'s patches, windows ``stride`` apart."""
    base = crop * SIDE * SIDE
    return [
        [base + (stride * r + dr) * SIDE + stride * c + dc for dr in (0, 1) for dc in (0, 1)]
        for r in range(grid[0])
        for c in range(grid[1])
    ]


def _molmo2_batch(model, highs: Sequence[Sequence[tuple[int, int]]], seed: int) -> Batch:
    """Rows ``[bos, text x a, image, (text x 2, image)..., text x b]`` (a = 3, 5, ..., b = 5, 7, ...);
    ``highs[r]`` lists row ``r``'s images by high-resolution grid. Sets ``row_inputs``."""
    rows, row_inputs = [], []
    for r, images in enumerate(highs):
        gen = row_generator(seed, r)
        row = [BOS_ID, *random_text(3 + 2 * r, gen)]
        for i, high in enumerate(images):
            if i:
                row += random_text(2, gen)
            row += molmo2_image_ids(high)
        rows.append(row + random_text(5 + 2 * r, gen))
        ids = torch.tensor([rows[-1]])
        row_inputs.append(
            {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "pixel_values": torch.randn((2 * len(images), SIDE**2, 3 * PATCH**2), generator=gen).to(
                    model.dtype
                ),
                "image_grids": torch.tensor([[*LOW_RES, *high] for high in images]),
                "image_token_pooling": torch.tensor(
                    [index for high in images for index in _pooling(LOW_RES, 0, 2) + _pooling(high, 1, 1)]
                ),
                "image_num_crops": torch.full((len(images),), 2),
                "mm_token_type_ids": torch.isin(ids, torch.tensor(IMAGE_TOKEN_IDS)).long(),
            }
        )
    ids, mask, _, _ = left_pad(rows, [(0, 0)] * len(rows))
    extra = {
        key: torch.cat([inputs[key] for inputs in row_inputs]) for key in ("image_grids", "image_num_crops")
    }
    extra["image_token_pooling"] = torch.cat([inputs["image_token_pooling"] for inputs in row_inputs])
    return Batch(
        ids,
        mask,
        torch.cat([inputs["pixel_values"] for inputs in row_inputs]),
        [],
        [],
        0,
        mm_token_type_ids=torch.isin(ids, torch.tensor(IMAGE_TOKEN_IDS)).long(),
        visual_ids=(IM_PATCH_ID,),
        extra=extra,
        row_inputs=row_inputs,
    )


def molmo2_batch(model, batch_size: int = 1, seed: int = 0) -> Batch:
    """One image per row: 2 x 2 global tokens and 3 x 3 high-resolution ones (13, in 5 runs)."""
    return _molmo2_batch(model, [[(3, 3)]] * batch_size, seed)


def molmo2_ragged_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """One image per row, high-resolution views of 3 x 3, 1 x 2, 2 x 3, ... tokens: 13, 6 and 10 in all."""
    highs = ((3, 3), (1, 2), (2, 3))
    return _molmo2_batch(model, [[highs[r % 3]] for r in range(batch_size)], seed)


def molmo2_multi_image_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """Two images per row, of 2 x 3 and 1 x 2 high-resolution tokens (row 1: the other way round)."""
    highs = [[(2, 3), (1, 2)] if r % 2 == 0 else [(1, 2), (2, 3)] for r in range(batch_size)]
    return _molmo2_batch(model, highs, seed)
