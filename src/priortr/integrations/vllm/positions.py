"""Positions of a pruned request, carried by vLLM's per-request M-RoPE bookkeeping.

vLLM asks a model for a request's positions once, when the request arrives
(``get_mrope_input_positions``), keeps them with the request (through preemption too) and continues
decoding at ``delta + tokens so far``. A pruned request holds K placeholders per image instead of N, so
its positions are those of the full prompt (N per image), taken at the prompt's text tokens, and its
``delta`` is the full prompt's, measured from the short prompt: decoding continues at the original,
unpruned positions (1-D RoPE and M-RoPE alike) with nothing keyed outside the request.

A placeholder's own position is never used: layers 0..L run on the full prompt, and the kept tokens
take their original positions after layer L. Its three slots instead carry a record the forward pass
reads (``request_records.SlotRecord``: length of the short prompt, image grid height, image grid width). The
prompt length tells a re-prefill after preemption (prompt + generated tokens in one step) where the
prompt ends, so that the scores use the prompt's rows only, as they did the first time. It is the
length the processor recorded with the request's images (``request_records.recorded_lengths``), never
the number of tokens handed in: vLLM's V1 runner asks once, with the prompt, but Model Runner V2 asks
again after a preemption, with the prompt and the generated tokens.

How a family lays out an image's tokens and their positions is its ``FamilyLayout``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from priortr.integrations.vllm.request_records import SlotRecord, break_rows

FullPositions = Callable[[list[int], Sequence[int]], tuple[torch.Tensor, int]]
"""(prompt with N placeholders per image, each image's first placeholder) -> ([3, S] positions, delta)."""


@dataclass(frozen=True)
class ImageSlots:
    """One image of a request: where its placeholders start in the scheduled prompt, how many it has
    (K), how many tokens the image has (N), its grid of merged patches (height, width), and the text
    tokens inside its layout: for each, how many of the image's N tokens come before it (Mistral 3's
    row breaks, ``FamilyLayout.breaks``; none for the other families). A pruned request's prompt has
    those text tokens right after the K slots (``request_records.shrink_prompt``)."""

    offset: int
    kept_count: int
    tokens: int
    grid: tuple[int, int]
    breaks: tuple[int, ...] = ()


@dataclass(frozen=True)
class FamilyLayout:
    """How a served family lays out an image's tokens and positions, the facts every step of a pruned
    request reads: ``linear_rope``, the family's layers take 1-D RoPE positions (0, 1, 2, ...), given
    vLLM's per-request M-RoPE bookkeeping on all three channels, else M-RoPE's (t, h, w); ``row_breaks``,
    the family writes a text token after every row of an image's grid but the last (Mistral 3:
    ``[IMG_BREAK]``; ``[IMG_END]`` after the last row is the text after the image); ``adjacent_images``,
    the family's images may stand back to back (no text between them), which ``priortr.apply`` prunes as
    one run under one budget and so does the plug-in (``processor.image_counts``): the 1-D RoPE families
    whose placeholder range is the image's tokens alone (LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision) serve
    them, the others refuse them (``processor.ADJACENT_REFUSED``)."""

    linear_rope: bool
    row_breaks: bool = False
    adjacent_images: bool = False

    def __post_init__(self) -> None:
        if self.row_breaks and not self.linear_rope:
            raise ValueError("priortr: row breaks inside an image are laid out for 1-D RoPE only")

    def breaks(self, grid: tuple[int, int]) -> tuple[int, ...]:
        """The text tokens inside an image of ``grid`` (rows, columns) visual tokens, as
        ``ImageSlots.breaks`` counts them: for each, how many of the image's tokens come before it."""
        if not self.row_breaks:
            return ()
        height, width = grid
        return tuple(range(width, height * width, width))

    def image_positions(self, base: int, grid: tuple[int, int]) -> torch.Tensor:
        """[3, n] positions of the n tokens of an image's layout (its N = height * width visual tokens
        and its row breaks) whose first token sits at ``base``: ``base + i`` on every channel for 1-D
        RoPE, else M-RoPE's (t, h, w) = base + (0, row, column)."""
        height, width = grid
        if self.linear_rope:
            return (base + torch.arange(height * width + len(self.breaks(grid)))).expand(3, -1).clone()
        index = torch.arange(height * width)
        return base + torch.stack([torch.zeros_like(index), index // width, index % width])

    def layer_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """What the family's layers take of vLLM's positions ([3, T] with M-RoPE bookkeeping): channel 0
        for 1-D RoPE, all three for M-RoPE."""
        return positions[0] if self.linear_rope and positions.ndim == 2 else positions


def request_positions(
    prompt: list[int],
    images: Sequence[ImageSlots],
    token_id: int,
    full_positions: FullPositions,
    prompt_length: int | None,
) -> tuple[torch.Tensor, int]:
    """[3, P] positions and delta of P scheduled tokens (a prompt, or after a preemption under Model
    Runner V2 a prompt and its generated tokens) whose images keep ``images[i].kept_count`` of their tokens;
    ``full_positions`` is the family's rule for the tokens with every image whole; ``prompt_length`` is
    the prompt's own length as the processor recorded it (None for a request that prunes nothing)."""
    ordered = sorted(images, key=lambda image: image.offset)
    if all(image.kept_count == image.tokens for image in ordered):
        return full_positions(prompt, [image.offset for image in ordered])
    if prompt_length is None or not ordered[-1].offset + ordered[-1].kept_count <= prompt_length <= len(
        prompt
    ):
        raise RuntimeError(
            f"priortr: a pruned request of {len(prompt)} tokens came with the prompt length "
            f"{prompt_length}; its images must carry the length the plug-in's processor recorded"
        )
    full: list[int] = []
    starts: list[int] = []
    source: list[int] = []  # for each scheduled token, its index in the full prompt (-1: placeholder)
    cursor = 0
    for image in ordered:
        source += range(len(full), len(full) + image.offset - cursor)
        full += prompt[cursor : image.offset]
        starts.append(len(full))
        source += [-1] * image.kept_count
        rows = break_rows(image.offset, image.kept_count, len(image.breaks))
        placed = 0
        for before, row in zip(image.breaks, rows, strict=True):  # text inside the image: after its slots
            full += [token_id] * (before - placed)
            placed = before
            source.append(len(full))
            full.append(prompt[row])
        full += [token_id] * (image.tokens - placed)
        cursor = rows.stop
    source += range(len(full), len(full) + len(prompt) - cursor)
    full += prompt[cursor:]
    positions, _ = full_positions(full, starts)
    short = torch.empty(3, len(prompt), dtype=positions.dtype)
    text = torch.tensor([i for i, s in enumerate(source) if s >= 0], dtype=torch.long)
    short[:, text] = positions[:, torch.tensor([s for s in source if s >= 0], dtype=torch.long)]
    for image in ordered:
        record = SlotRecord(prompt_length, image.grid).encode(positions.dtype)
        short[:, image.offset : image.offset + image.kept_count] = record[:, None]
    return short, int(positions.max()) + 1 - len(prompt)


def linear_positions(prompt: list[int], starts: Sequence[int]) -> tuple[torch.Tensor, int]:
    """1-D RoPE's positions (0, 1, 2, ...) on all three M-RoPE channels, and delta 0."""
    return torch.arange(len(prompt)).expand(3, -1).clone(), 0
