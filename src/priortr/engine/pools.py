"""Which visual tokens a method ranks together, and how many of them each stage keeps.

A prompt row may hold several images or videos (``VisualItem``s), and rows of a batch may hold
different numbers of visual tokens (dynamic resolution). A *pool* is the set of tokens one selector
call ranks: by default each item is its own pool, with its own prior and posterior normalised over its
tokens and a row's count budget split over its items in proportion to their token counts;
``multi_image='global'`` makes all items of a row one pool, ranked against each other under one
budget. A ratio budget is the same ratio of every pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from priortr.adapters.base import VisualItem


@dataclass(frozen=True)
class Pool:
    """The visual tokens of one row that are ranked together, as they stand before a stage (a stage's
    cut makes the narrowed pool, ``after_cut``).

    ``positions``, ``item_of`` and ``offset`` are aligned [n]: a surviving token's absolute prompt
    position, which of ``items`` it belongs to, and its index among that item's tokens (which the
    vision tower's outputs are indexed by). ``stages`` holds (scored layer, tokens kept after it) pairs,
    ascending by layer: a tuple, so that the plan stays frozen and a compiled stage reads it without a
    graph break (dynamo traces tuples; it breaks on a ``MappingProxyType``).
    ``row_index`` [1] is ``row`` as a tensor beside the others, so that a stage indexes the batch by
    it without making a tensor from host data.
    """

    row: int
    items: tuple[VisualItem, ...]
    separators: tuple[int, ...]  # absolute prior slot of each item
    stages: tuple[tuple[int, int], ...]
    positions: torch.Tensor
    item_of: torch.Tensor
    offset: torch.Tensor
    row_index: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.positions.numel())

    @property
    def layers(self) -> tuple[int, ...]:
        """The scored layers of this pool's stages, ascending."""
        return tuple(layer for layer, _ in self.stages)

    def kept_count(self, layer: int) -> int:
        """The tokens this pool keeps after its stage at scored ``layer`` (one of ``layers``)."""
        for scored, kept in self.stages:
            if scored == layer:
                return kept
        raise KeyError(f"priortr: pool has no stage at layer {layer}; its stages are at {self.layers}")

    def after_cut(self, positions: torch.Tensor, item_of: torch.Tensor, offset: torch.Tensor) -> Pool:
        """The pool of the surviving tokens, given as their positions, items and offsets (ascending)."""
        return replace(self, positions=positions, item_of=item_of, offset=offset)


@dataclass(frozen=True)
class ItemGroup:
    """Items of one row that one pool ranks together (prompt order), and their share of the row:
    ``part`` = (the row's visual tokens before them, all of them) when the row holds several groups,
    which splits a count budget over them in proportion to their sizes (None: the row's only group)."""

    row: int
    items: tuple[VisualItem, ...]
    part: tuple[int, int] | None

    @property
    def size(self) -> int:
        return sum(item.size for item in self.items)


def group_items(items: Sequence[VisualItem], multi_image: str) -> list[ItemGroup]:
    """Group ``items`` (prompt order) into what each pool will rank: an item each (``per_image``), or all
    of a row's items together (``global``)."""
    rows: dict[int, list[VisualItem]] = {}
    for item in items:
        rows.setdefault(item.row, []).append(item)
    out = []
    for row, row_items in rows.items():
        groups = [row_items] if multi_image == "global" else [[item] for item in row_items]
        total = sum(item.size for item in row_items)
        before = 0
        for group in groups:
            part = None if len(groups) == 1 else (before, total)
            before += sum(item.size for item in group)
            out.append(ItemGroup(row, tuple(group), part))
    return out


def make_pools(
    groups: Sequence[ItemGroup], stages: Sequence[Sequence[tuple[int, int]]], separator_offset: int
) -> list[Pool]:
    """The pool of each of ``groups``, with its (scored layer, tokens kept after it) ``stages`` (aligned
    with ``groups``); a pool's prior slot is each item's separator moved by ``separator_offset``."""
    if len(stages) != len(groups):
        raise ValueError(f"{len(stages)} schedules for {len(groups)} pools; pass one schedule per pool")
    pools = []
    for group, schedule in zip(groups, stages, strict=True):
        items = group.items
        device = items[0].positions.device
        pools.append(
            Pool(
                row=group.row,
                items=items,
                separators=tuple(item.separator + separator_offset for item in items),
                stages=tuple(sorted(dict(schedule).items())),
                positions=torch.cat([item.positions for item in items]),
                item_of=torch.cat(
                    [torch.full((item.size,), i, device=device) for i, item in enumerate(items)]
                ),
                offset=torch.cat([torch.arange(item.size, device=device) for item in items]),
                row_index=torch.tensor([group.row], device=device),
            )
        )
    return pools


TENSOR_FIELDS = ("positions", "item_of", "offset", "row_index")
"""The fields of a ``Pool`` that hold tensors (moved to the model's device with the plan)."""
