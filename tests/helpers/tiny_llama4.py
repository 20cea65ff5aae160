"""A tiny Llama 4 and batches laid out as ``Llama4Processor`` writes prompts.

An image of ``rows x cols`` tiles is ``<|image_start|>``, the tiles row by row (``<|patch|> x n`` each,
``<|tile_x_separator|>`` between the tiles of a row, ``<|tile_y_separator|>`` after each row), then
``<|image|>`` and the global view (``<|patch|> x n``), then ``<|image_end|>``; an image of one tile is only
the global view. Only ``<|patch|>`` (``image_token_index``) receives image features, one tile's worth per
``pixel_values`` entry (tiles first, the global view last).

The text model (``LAYER_TYPES``) mixes chunked-attention layers with RoPE and global layers without it
(NoPE, whose queries get the attention temperature once positions reach ``floor_scale``), with MoE feed
forwards in layers 1 and 3 and a small ``attention_chunk_size`` (``CHUNK``), so that chunk edges fall
inside the prompts below and decoding crosses one. Layers 1 and 2, which the suites score (the
equivalence suites' layer and the paper's default), are global: at a chunked layer most image tokens lie
outside every text row's chunk, so their evidence is zero and ties decide. ``floor_scale`` is the
released 8192 unless a test sets a tiny one to make the temperature change inside a prompt.

Same conventions as ``tests.helpers.tiny``: special ids at the top of the vocabulary, random text from
``[TEXT_LO, TEXT_HI)``, left padding, row ``r`` depends only on ``(seed, r)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import transformers
from transformers import Llama4Config, Llama4ForConditionalGeneration

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

LLAMA4_PATCH_ID, LLAMA4_START_ID, LLAMA4_END_ID = 199, 198, 197
LLAMA4_GLOBAL_ID, LLAMA4_TILE_X_ID, LLAMA4_TILE_Y_ID = 196, 195, 194
TILE_PIXELS = 32
TILE_TOKENS = 4  # 4 x 4 patches of 8 px, pixel-shuffled by 0.5
LAYER_TYPES = ["chunked_attention", "full_attention", "full_attention", "chunked_attention"]
CHUNK = 12
TILES = (2, 2)


def tiny_llama4(
    dtype: torch.dtype = torch.float64,
    attn: str = "sdpa",
    seed: int = 0,
    chunk: int = CHUNK,
    floor_scale: int = 8192,
) -> Llama4ForConditionalGeneration:
    """A 4-layer Llama 4 text model (``LAYER_TYPES``, chunks of ``chunk``, two experts in layers 1 and 3)
    + 2-layer vision tower; one tile of 32x32 px becomes ``TILE_TOKENS`` visual tokens."""
    text = {
        **TEXT_CONFIG,
        "intermediate_size": 32,
        "intermediate_size_mlp": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "no_rope_layers": [int(kind == "chunked_attention") for kind in LAYER_TYPES],
        "attention_chunk_size": chunk,
        "floor_scale": floor_scale,
        "attn_scale": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 128,  # hidden_size / pixel_shuffle_ratio ** 2: the pixel-shuffle MLP's input
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": TILE_PIXELS,
        "patch_size": 8,
        "pixel_shuffle_ratio": 0.5,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
        "vision_output_dim": 64,
    }
    config = Llama4Config(
        text_config=text,
        vision_config=vision,
        boi_token_index=LLAMA4_START_ID,
        eoi_token_index=LLAMA4_END_ID,
        image_token_index=LLAMA4_PATCH_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = Llama4ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    assert model.config.text_config.layer_types == LAYER_TYPES
    model = finish_model(model, attn)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[BOS_ID]]))
    except AttributeError as error:  # 5.24.0 alone reads outputs.image_outputs, absent from the text output
        pytest.skip(f"transformers {transformers.__version__}'s own Llama 4 forward fails: {error}")
    return model


def image_tokens(tiles: tuple[int, int]) -> list[int]:
    """The ids of one image of ``tiles`` (rows, cols) tiles, as ``Llama4Processor`` writes them."""
    rows, cols = tiles
    patch = [LLAMA4_PATCH_ID] * TILE_TOKENS
    out = [LLAMA4_START_ID]
    if rows * cols > 1:
        for _ in range(rows):
            for x in range(cols):
                out += patch if x == cols - 1 else [*patch, LLAMA4_TILE_X_ID]
            out.append(LLAMA4_TILE_Y_ID)
    return [*out, LLAMA4_GLOBAL_ID, *patch, LLAMA4_END_ID]


def llama4_batch(
    model, batch_size: int = 1, tiles: Sequence[Sequence[tuple[int, int]]] | None = None, seed: int = 0
) -> Batch:
    """Rows ``[bos, text x a, image, (text x 2, image)..., text x b]``, left-padded; ``tiles[r]`` are row
    ``r``'s images (default: one image of ``TILES`` per row, 20 visual tokens)."""
    tiles = [[TILES]] * batch_size if tiles is None else [list(row) for row in tiles]
    rows, pixels = [], []
    lengths = zip(row_lengths((3,), batch_size), row_lengths((5,), batch_size), strict=True)
    for r, (a, b) in enumerate(lengths):
        gen = row_generator(seed, r)
        row = [BOS_ID, *random_text(a, gen)]
        for k, grid in enumerate(tiles[r]):
            row += [*(random_text(2, gen) if k else []), *image_tokens(grid)]
            count = grid[0] * grid[1] + (grid[0] * grid[1] > 1)
            pixels += [torch.randn((3, TILE_PIXELS, TILE_PIXELS), generator=gen) for _ in range(count)]
        rows.append([*row, *random_text(b, gen)])
    ids, mask, _, _ = left_pad(rows, [(0, 0)] * batch_size)
    return Batch(ids, mask, torch.stack(pixels).to(model.dtype), [], [], 0, visual_ids=(LLAMA4_PATCH_ID,))


def llama4_ragged_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """One image per row, alternately of one tile (4 visual tokens) and of 2 x 2 tiles (20)."""
    return llama4_batch(model, batch_size, [[((1, 1), TILES)[r % 2]] for r in range(batch_size)], seed)


def llama4_multi_image_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """Two images per row, of 1 x 2 tiles (12 visual tokens) then of one tile (4), two text tokens between."""
    return llama4_batch(model, batch_size, [[(1, 2), (1, 1)]] * batch_size, seed)
