"""A tiny Mistral 3 (Pixtral vision tower) and batches laid out as ``PixtralProcessor`` writes prompts.

An image of ``H x W`` pixels becomes ``rows x cols`` visual tokens, ``rows = H // 8``, ``cols = W // 8``
(4-pixel patches merged 2 x 2), written row by row with a row break after each row and the last break
replaced by the end marker (``PixtralProcessor._expand_image_tokens``)::

    [IMG] x cols [IMG_BREAK]  ...  [IMG] x cols [IMG_END]

Only the ``[IMG]`` positions receive image features; ``[IMG_BREAK]`` and ``[IMG_END]`` are ordinary token
embeddings. ``pixel_values`` are ``[images, 3, H_max, W_max]`` (zero-padded to the batch's largest image)
with ``image_sizes`` giving each image's own size, images in prompt order.

Same conventions as ``tests.helpers.tiny``: special ids at the top of the vocabulary, random text from
``[TEXT_LO, TEXT_HI)``, left padding, row ``r`` depends only on ``(seed, r)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Mistral3Config, Mistral3ForConditionalGeneration

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

MISTRAL3_IMAGE_ID, MISTRAL3_BREAK_ID, MISTRAL3_END_ID = 199, 198, 197
PATCH_SIZE, MERGE = 4, 2
TOKEN_PIXELS = PATCH_SIZE * MERGE  # one visual token covers 8 x 8 pixels
IMAGE = (32, 40)  # 4 rows of 5 tokens: 20 visual tokens
SMALL_IMAGE = (16, 16)  # 2 rows of 2 tokens


def tiny_mistral3(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0, sliding_window: int | None = None
) -> Mistral3ForConditionalGeneration:
    """A 4-layer Mistral + 2-layer Pixtral Mistral 3 (no sliding window, as Mistral Small 3.1's text model;
    ``sliding_window`` gives every layer one)."""
    text = {**TEXT_CONFIG, "model_type": "mistral", "head_dim": 16, "sliding_window": sliding_window}
    vision = {
        "model_type": "pixtral",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 16,
        "image_size": 48,
        "patch_size": PATCH_SIZE,
    }
    config = Mistral3Config(
        text_config=text,
        vision_config=vision,
        image_token_index=MISTRAL3_IMAGE_ID,
        spatial_merge_size=MERGE,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    return finish_model(model, attn)


def image_tokens(size: tuple[int, int]) -> list[int]:
    """The placeholder ids of one image of ``size`` (H, W) pixels, with its row breaks and end marker."""
    rows, cols = size[0] // TOKEN_PIXELS, size[1] // TOKEN_PIXELS
    tokens = [token for _ in range(rows) for token in [*[MISTRAL3_IMAGE_ID] * cols, MISTRAL3_BREAK_ID]]
    tokens[-1] = MISTRAL3_END_ID
    return tokens


def mistral3_batch(
    model,
    batch_size: int = 1,
    sizes: Sequence[Sequence[tuple[int, int]]] | None = None,
    seed: int = 0,
) -> Batch:
    """Rows ``[bos, text x a, image, (text x 2, image)..., text x b]``, left-padded; ``sizes[r]`` are row
    ``r``'s image sizes (default: one ``IMAGE`` per row, 20 visual tokens)."""
    sizes = [[IMAGE]] * batch_size if sizes is None else [list(row) for row in sizes]
    rows, pixels, image_sizes = [], [], []
    lengths = zip(row_lengths((3,), batch_size), row_lengths((5,), batch_size), strict=True)
    for r, (a, b) in enumerate(lengths):
        gen = row_generator(seed, r)
        row = [BOS_ID, *random_text(a, gen)]
        for k, size in enumerate(sizes[r]):
            if k:
                row += random_text(2, gen)
            row += image_tokens(size)
            pixels.append(torch.randn((3, *size), generator=gen))
            image_sizes.append(size)
        rows.append([*row, *random_text(b, gen)])
    ids, mask, _, _ = left_pad(rows, [(0, 0)] * batch_size)
    height = max(size[0] for size in image_sizes)
    width = max(size[1] for size in image_sizes)
    padded = torch.zeros(len(pixels), 3, height, width)
    for k, image in enumerate(pixels):
        padded[k, :, : image.shape[1], : image.shape[2]] = image
    return Batch(
        ids,
        mask,
        padded.to(model.dtype),
        [],
        [],
        0,
        visual_ids=(MISTRAL3_IMAGE_ID,),
        extra={"image_sizes": torch.tensor(image_sizes, dtype=torch.long)},
    )


def mistral3_ragged_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """One image per row, alternately 4 and 20 visual tokens (2 x 2 and 4 x 5 rows of tokens)."""
    return mistral3_batch(model, batch_size, [[(SMALL_IMAGE, IMAGE)[r % 2]] for r in range(batch_size)], seed)


def mistral3_multi_image_batch(model, batch_size: int = 2, seed: int = 0) -> Batch:
    """Two images per row, 4 then 20 visual tokens, two text tokens between them."""
    return mistral3_batch(model, batch_size, [[SMALL_IMAGE, IMAGE]] * batch_size, seed)
