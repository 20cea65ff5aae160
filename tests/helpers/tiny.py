"""Tiny, randomly initialised multimodal models and matching input batches for the tests.

Nothing here touches the network: every model is built from a config with random weights
(``torch.manual_seed(seed)`` makes them reproducible) and every batch is random token ids plus
random pixels of the right shape. The models are small enough that a float64 forward pass and a
short ``generate()`` run in milliseconds on a CPU.

Token-id layout shared by all builders (vocabulary of ``VOCAB`` ids):

* ``PAD_ID = 0``, ``BOS_ID = 1``, ``EOS_ID = 2``;
* the multimodal special ids sit at the top of the vocabulary (``>= TEXT_HI``);
* "text" tokens are drawn from ``[TEXT_LO, TEXT_HI)``, which avoids every special id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

VOCAB = 200
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
TEXT_LO, TEXT_HI = 3, 190  # text ids are drawn from [TEXT_LO, TEXT_HI)

# LLaVA special id.
LLAVA_IMAGE_ID = 199
# Qwen2-VL / Qwen2.5-VL special ids.
QWEN_VISION_START_ID, QWEN_VISION_END_ID, QWEN_VIDEO_ID, QWEN_IMAGE_ID = 195, 196, 197, 198

# Shared tiny text-model sizes: head_dim = 64 / 4 = 16, so M-RoPE sections must sum to 8.
TEXT_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}

LLAVA_IMAGE_SIZE, LLAVA_PATCH_SIZE = 28, 7
LLAVA_N_VISUAL = (LLAVA_IMAGE_SIZE // LLAVA_PATCH_SIZE) ** 2  # 16 patch tokens (CLS dropped by "default")


def finish_model(model: PreTrainedModel, attn: str) -> PreTrainedModel:
    """Put ``model`` in eval mode and check that ``attn`` reached both sub-models."""
    model.eval()
    for cfg in (model.config, model.config.text_config, model.config.vision_config):
        assert cfg._attn_implementation == attn, (type(cfg).__name__, cfg._attn_implementation, attn)
    return model


def tiny_llava(
    dtype: torch.dtype = torch.float64,
    attn: str = "sdpa",
    seed: int = 0,
    *,
    image_size: int = LLAVA_IMAGE_SIZE,
    patch_size: int = LLAVA_PATCH_SIZE,
    text: dict[str, Any] | None = None,
) -> LlavaForConditionalGeneration:
    """A 4-layer Llama + 2-layer CLIP LLaVA; one 28x28 image becomes 16 visual tokens. ``image_size``
    and ``patch_size`` set another patch grid, ``text`` overrides the Llama config (e.g. its depth)."""
    vision = CLIPVisionConfig(
        image_size=image_size,
        patch_size=patch_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=LlamaConfig(**{**TEXT_CONFIG, **(text or {})}),
        image_token_id=LLAVA_IMAGE_ID,
        image_seq_length=(image_size // patch_size) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    return finish_model(model, attn)


def _qwen_text(**extra: Any) -> dict[str, Any]:
    """Text-config kwargs shared by the two Qwen builders (M-RoPE sections 2+3+3 = head_dim / 2)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    return {**TEXT_CONFIG, "rope_parameters": rope, **extra}


def qwen_special_ids() -> dict[str, int]:
    """The Qwen-VL config's image, video and vision start/end token ids."""
    return {
        "image_token_id": QWEN_IMAGE_ID,
        "video_token_id": QWEN_VIDEO_ID,
        "vision_start_token_id": QWEN_VISION_START_ID,
        "vision_end_token_id": QWEN_VISION_END_ID,
    }


def tiny_qwen2_vl(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> Qwen2VLForConditionalGeneration:
    """A 4-layer Qwen2-VL with a 2-block vision tower (patch 14, 2x2 spatial merge, 2 frames per patch)."""
    vision = {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": TEXT_CONFIG["hidden_size"],  # Qwen2-VL: merger output size = text hidden size
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config = Qwen2VLConfig(
        text_config=_qwen_text(), vision_config=vision, pad_token_id=PAD_ID, **qwen_special_ids()
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    return finish_model(model, attn)


def tiny_qwen2_5_vl(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> Qwen2_5_VLForConditionalGeneration:
    """A 4-layer Qwen2.5-VL with a 2-block vision tower (block 0 windowed, block 1 full attention)."""
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": TEXT_CONFIG["hidden_size"],
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,  # 56 / 14 / 2 = 2 merged patches per window side
        "fullatt_block_indexes": [1],
    }
    config = Qwen2_5_VLConfig(
        text_config=_qwen_text(), vision_config=vision, pad_token_id=PAD_ID, **qwen_special_ids()
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    return finish_model(model, attn)


@dataclass
class Batch:
    """Model inputs plus the layout facts the tests need.

    ``image_start[r]`` / ``image_end[r]`` are absolute positions in the (left-padded) row ``r``:
    the visual tokens occupy ``[image_start[r], image_end[r])``, and ``image_end[r]`` holds the
    separator token that follows them (a text token for LLaVA, ``<|vision_end|>`` for Qwen).
    Every row has exactly ``n_visual`` visual tokens.

    Families whose visual tokens are not one run per row (several images, sub-image splits, ragged
    rows) set ``visual_ids`` (the placeholder ids that ``visual_mask`` finds) and leave the span
    fields empty; ``extra`` holds any further model inputs (``image_sizes``, ``pixel_values_videos``, ...).
    """

    input_ids: torch.LongTensor  # [B, S]
    attention_mask: torch.LongTensor  # [B, S], 0 on left padding
    pixel_values: (
        torch.Tensor | None
    )  # LLaVA: [B, 3, H, W]; Qwen: [sum(t*h*w), 3 * temporal_patch * patch**2]
    image_start: list[int]
    image_end: list[int]
    n_visual: int
    image_grid_thw: torch.LongTensor | None = None  # Qwen only: [B, 3]
    mm_token_type_ids: torch.LongTensor | None = None  # Qwen only: [B, S], 1 on image tokens
    visual_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    images_per_row: list[int] | None = None  # where rows hold different image counts (one input each)
    row_inputs: list[dict[str, Any]] | None = None  # each row's own inputs, where the batch packs rows'
    # images in a way ``row_alone`` cannot split (MiniCPM-V's NaViT packing, Molmo2's pooling indices)

    def __post_init__(self) -> None:
        """``n_visual`` 0 with ``visual_ids`` means: the rows' common count, if they share one."""
        if self.n_visual == 0 and self.visual_ids:
            counts = set(self.visual_mask().sum(dim=1).tolist())
            self.n_visual = counts.pop() if len(counts) == 1 else 0

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def visual_mask(self) -> torch.BoolTensor:
        """[B, S] True on the visual-token positions."""
        if self.visual_ids:
            return torch.isin(self.input_ids, torch.tensor(self.visual_ids))
        pos = torch.arange(self.seq_len)
        start = torch.tensor(self.image_start)[:, None]
        end = torch.tensor(self.image_end)[:, None]
        return (pos >= start) & (pos < end)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``model(**...)`` / ``model.generate(**...)``."""
        out: dict[str, Any] = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "pixel_values": self.pixel_values,
        }
        if self.image_grid_thw is not None:
            out["image_grid_thw"] = self.image_grid_thw
        if self.mm_token_type_ids is not None:
            out["mm_token_type_ids"] = self.mm_token_type_ids
        # generate() encodes every modality whose key it is given, even as None
        return {key: value for key, value in {**out, **self.extra}.items() if value is not None}


def row_lengths(spec: Sequence[int], batch_size: int) -> list[int]:
    """Per-row text lengths: ``spec[r]`` where given, else the last entry + 2 per extra row.

    So the default ``(3,)`` gives rows of 3, 5, 7, ... tokens: different rows differ in length,
    which forces left padding in every multi-row batch.
    """
    assert len(spec) >= 1 and min(spec) >= 0
    return [spec[r] if r < len(spec) else spec[-1] + 2 * (r - len(spec) + 1) for r in range(batch_size)]


def random_text(n: int, gen: torch.Generator) -> list[int]:
    """``n`` text ids drawn from ``[TEXT_LO, TEXT_HI)``."""
    return torch.randint(TEXT_LO, TEXT_HI, (n,), generator=gen).tolist()


def left_pad(
    rows: list[list[int]], visual_ranges: list[tuple[int, int]]
) -> tuple[torch.LongTensor, torch.LongTensor, list[int], list[int]]:
    """Left-pad ``rows`` with ``PAD_ID``; shift the per-row visual ranges accordingly."""
    seq_len = max(len(r) for r in rows)
    ids = torch.full((len(rows), seq_len), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(rows), seq_len), dtype=torch.long)
    starts, ends = [], []
    for r, (row, (a, b)) in enumerate(zip(rows, visual_ranges, strict=True)):
        off = seq_len - len(row)
        ids[r, off:] = torch.tensor(row)
        mask[r, off:] = 1
        starts.append(a + off)
        ends.append(b + off)
    return ids, mask, starts, ends


def row_generator(seed: int, row: int) -> torch.Generator:
    """Row ``row``'s own generator, so a row's content does not depend on the batch size."""
    return torch.Generator().manual_seed(1000 * seed + row)


def llava_batch(
    model: LlavaForConditionalGeneration,
    batch_size: int = 1,
    seed: int = 0,
    text_before: Sequence[int] = (3,),
    text_after: Sequence[int] = (5,),
    images: int = 1,
) -> Batch:
    """Rows ``[bos, text x a, <image> x 16, sep, text x b]``, left-padded, ``images`` images per row
    (each further image after two more text tokens).

    Row ``r``'s tokens and pixels depend only on ``(seed, r)``: row 0 of a 2-row batch is the
    1-row batch plus left padding. ``a``/``b`` per row come from ``text_before``/``text_after``
    (see ``row_lengths``). With several images per row the span fields stay empty and
    ``visual_ids`` finds the visual tokens.
    """
    n_visual = model.config.image_seq_length
    size = model.config.vision_config.image_size
    rows, ranges, pixels = [], [], []
    lengths = zip(row_lengths(text_before, batch_size), row_lengths(text_after, batch_size), strict=True)
    for r, (a, b) in enumerate(lengths):
        gen = row_generator(seed, r)
        start = 1 + a
        row = [BOS_ID, *random_text(a, gen), *[LLAVA_IMAGE_ID] * n_visual]
        for _ in range(images - 1):
            row += [*random_text(2, gen), *[LLAVA_IMAGE_ID] * n_visual]
        rows.append([*row, *random_text(1 + b, gen)])
        ranges.append((start, start + n_visual))
        pixels += [torch.randn((3, size, size), generator=gen) for _ in range(images)]
    ids, mask, starts, ends = left_pad(rows, ranges)
    if images > 1:
        return Batch(
            ids,
            mask,
            torch.stack(pixels).to(model.dtype),
            [],
            [],
            n_visual * images,
            visual_ids=(LLAVA_IMAGE_ID,),
        )
    return Batch(
        ids, mask, torch.stack(pixels).to(model.dtype), starts, ends, n_visual
    )  # pixels [B, 3, H, W]


def qwen_batch(
    model: Qwen2VLForConditionalGeneration | Qwen2_5_VLForConditionalGeneration,
    batch_size: int = 1,
    grid: tuple[int, int, int] | Sequence[tuple[int, int, int]] = (1, 4, 4),
    seed: int = 0,
    text_before: Sequence[int] = (3,),
    text_after: Sequence[int] = (5,),
) -> Batch:
    """Rows ``[text x a, <vision_start>, <image_pad> x N, <vision_end>, text x b]``, left-padded.

    ``grid = (t, h, w)`` is the patch grid of each row's single image (``h``, ``w`` multiples of
    the spatial merge size), so ``N = t*h*w / merge**2`` visual tokens per row (4 by default,
    16 for ``(1, 8, 8)``); a list of grids gives each row its own (a ragged batch, ``n_visual`` 0).
    As in ``llava_batch``, row ``r`` depends only on ``(seed, r)``.
    """
    vc = model.config.vision_config
    grids = [grid] * batch_size if isinstance(grid[0], int) else list(grid)
    merge = vc.spatial_merge_size
    patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    rows, ranges, pixels = [], [], []
    lengths = zip(row_lengths(text_before, batch_size), row_lengths(text_after, batch_size), strict=True)
    for r, (a, b) in enumerate(lengths):
        t, h, w = grids[r]
        assert h % merge == 0 and w % merge == 0, grids[r]
        n_visual = t * h * w // merge**2
        gen = row_generator(seed, r)
        start = a + 1
        image = [QWEN_VISION_START_ID, *[QWEN_IMAGE_ID] * n_visual, QWEN_VISION_END_ID]
        rows.append([*random_text(a, gen), *image, *random_text(b, gen)])
        ranges.append((start, start + n_visual))
        pixels.append(torch.randn((t * h * w, patch_dim), generator=gen))
    ids, mask, starts, ends = left_pad(rows, ranges)
    counts = {end - start for start, end in ranges}
    return Batch(
        ids,
        mask,
        torch.cat(pixels).to(model.dtype),  # [sum(t*h*w), patch_dim]
        starts,
        ends,
        counts.pop() if len(counts) == 1 else 0,
        image_grid_thw=torch.tensor(grids, dtype=torch.long),  # [B, 3]
        mm_token_type_ids=(ids == QWEN_IMAGE_ID).long(),  # [B, S]: 0 text, 1 image (2 would be video)
    )


def qwen_video_batch(
    model, batch_size: int = 2, grid: tuple[int, int, int] = (2, 4, 4), seed: int = 0
) -> Batch:
    """``qwen_batch`` with a video instead of an image: ``<|video_pad|>`` tokens, ``pixel_values_videos``
    and ``video_grid_thw`` (``t`` temporal patches of two frames each; 8 visual tokens by default)."""
    image = qwen_batch(model, batch_size, grid=grid, seed=seed)
    ids = image.input_ids.masked_fill(image.input_ids == QWEN_IMAGE_ID, QWEN_VIDEO_ID)
    return Batch(
        ids,
        image.attention_mask,
        None,
        [],
        [],
        0,
        mm_token_type_ids=2 * (ids == QWEN_VIDEO_ID).long(),
        visual_ids=(QWEN_VIDEO_ID,),
        extra={"pixel_values_videos": image.pixel_values, "video_grid_thw": image.image_grid_thw},
    )


def qwen_batch_12(model, batch_size: int) -> Batch:
    """``qwen_batch`` with a 6x8 patch grid: 12 visual tokens per row."""
    return qwen_batch(model, batch_size=batch_size, grid=(1, 6, 8))


def language_model_inputs(model, batch: Batch) -> dict[str, Any]:
    """The keyword arguments the stock multimodal ``model`` hands its language model for ``batch``
    (merged ``inputs_embeds``, ``position_ids``, ...), read by a pre-hook on one plain forward."""
    seen: dict[str, Any] = {}
    lm = model.model.language_model
    handle = lm.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    try:
        with torch.no_grad():
            model(**batch.kwargs())
    finally:
        handle.remove()
    return seen
