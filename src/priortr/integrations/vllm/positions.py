"""Positions of a pruned request, carried by vLLM's per-request M-RoPE bookkeeping.

vLLM asks a model for a request's positions once, when the request arrives
(``get_mrope_input_positions``), keeps them with the request (through preemption too) and continues
decoding at ``delta + tokens so far``. A pruned request holds K placeholders per image instead of N, so
its positions are those of the full prompt (N per image), taken at the prompt's text tokens, and its
``delta`` is the full prompt's, measured from the short prompt: decoding continues at the original,
unpruned positions (1-D RoPE and M-RoPE alike) with nothing keyed outside the request.

A placeholder's own position is never used: layers 0..L run on the full prompt, and the kept tokens
take their original positions after layer L. Its three slots instead carry a *record* the forward pass
reads: (length of the short prompt, image grid height, image grid width). The prompt length tells a
re-prefill after preemption (prompt + generated tokens in one step) where the prompt ends, so that the
scores use the prompt's rows only, as they did the first time. It is the length the processor recorded
with the request's images, never the number of tokens handed in: vLLM's V1 runner asks once, with the
prompt, but Model Runner V2 asks again after a preemption, with the prompt and the generated tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

FullPositions = Callable[[list[int], Sequence[int]], tuple[torch.Tensor, int]]
"""(prompt with N placeholders per image, each image's first placeholder) -> ([3, S] positions, delta)."""


@dataclass(frozen=True)
class ImageSlots:
    """One image of a request: where its placeholders start in the scheduled prompt, how many it has
    (K), how many tokens the image has (N), its grid of merged patches (height, width), and the text
    tokens inside its layout: for each, how many of the image's N tokens come before it (Mistral 3's
    row breaks, ``row_breaks``; none for the other families). A pruned request's prompt has those text
    tokens right after the K slots (``processor.shrink_prompt``)."""

    offset: int
    kept: int
    tokens: int
    grid: tuple[int, int]
    breaks: tuple[int, ...] = ()


def row_breaks(grid: tuple[int, int]) -> tuple[int, ...]:
    """The text tokens inside an image laid out as ``grid`` rows of visual tokens with a row break
    after every row but the last (Mistral 3: ``[IMG_BREAK]``; ``[IMG_END]`` after the last row is the
    text after the image), as ``ImageSlots.breaks`` counts them."""
    height, width = grid
    return tuple(range(width, height * width, width))


def request_positions(
    prompt: list[int],
    images: Sequence[ImageSlots],
    token_id: int,
    full_positions: FullPositions,
    prompt_length: int | None,
) -> tuple[torch.Tensor, int]:
    """[3, P] positions and delta of P scheduled tokens (a prompt, or after a preemption under Model
    Runner V2 a prompt and its generated tokens) whose images keep ``images[i].kept`` of their tokens;
    ``full_positions`` is the family's rule for the tokens with every image whole; ``prompt_length`` is
    the prompt's own length as the processor recorded it (None for a request that prunes nothing)."""
    ordered = sorted(images, key=lambda image: image.offset)
    if all(image.kept == image.tokens for image in ordered):
        return full_positions(prompt, [image.offset for image in ordered])
    if prompt_length is None or not ordered[-1].offset + ordered[-1].kept <= prompt_length <= len(prompt):
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
        source += [-1] * image.kept
        cursor = image.offset + image.kept
        placed = 0
        for before in image.breaks:  # the text tokens inside the image follow its K slots
            full += [token_id] * (before - placed)
            placed = before
            source.append(len(full))
            full.append(prompt[cursor])
            cursor += 1
        full += [token_id] * (image.tokens - placed)
    source += range(len(full), len(full) + len(prompt) - cursor)
    full += prompt[cursor:]
    positions, _ = full_positions(full, starts)
    short = torch.empty(3, len(prompt), dtype=positions.dtype)
    text = torch.tensor([i for i, s in enumerate(source) if s >= 0], dtype=torch.long)
    short[:, text] = positions[:, torch.tensor([s for s in source if s >= 0], dtype=torch.long)]
    for image in ordered:
        record = torch.tensor([prompt_length, *image.grid], dtype=positions.dtype)
        short[:, image.offset : image.offset + image.kept] = record[:, None]
    return short, int(positions.max()) + 1 - len(prompt)


def linear_positions(prompt: list[int], starts: Sequence[int]) -> tuple[torch.Tensor, int]:
    """1-D RoPE's positions (0, 1, 2, ...) on all three M-RoPE channels, and delta 0."""
    return torch.arange(len(prompt)).expand(3, -1).clone(), 0


def image_positions(base: int, grid: tuple[int, int], linear: bool) -> torch.Tensor:
    """[3, N] positions of an image's N = height * width tokens whose first token sits at ``base``:
    ``base + i`` on every channel for 1-D RoPE, else M-RoPE's (t, h, w) = base + (0, row, column)."""
    height, width = grid
    index = torch.arange(height * width)
    if linear:
        return (base + index).expand(3, -1).clone()
    return base + torch.stack([torch.zeros_like(index), index // width, index % width])
