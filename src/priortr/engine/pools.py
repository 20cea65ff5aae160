"""Which visual tokens a method ranks together, and how many of them each stage keeps.

A prompt row may hold several images or videos (``VisualItem``s), and rows of a batch may hold
different numbers of visual tokens (dynamic resolution). A *pool* is the set of tokens one selector
call ranks: by default each item is its own pool, with its own prior and posterior normalised over its
tokens and a row's count budget split over its items in proportion to their token counts;
``multi_image='global'`` makes all items of a row one pool, ranked against each other under one
budget. A ratio budget is the same ratio of every pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from priortr.adapters.base import VisualItem


@dataclass(frozen=True)
class Pool:
    """The visual tokens of one row that are ranked together, as they stand before a stage (a stage's
    cut makes the narrowed pool, ``kept``).

    ``positions``, ``item_of`` and ``offset`` are aligned [n]: a surviving token's absolute prompt
    position, which of ``items`` it belongs to, and its index among that item's tokens (which the
    vision tower's outputs are indexed by). ``stages`` maps a scored layer to the tokens kept after it.
    ``row_index`` [1] is ``row`` as a tensor beside the others, so that a stage indexes the batch by
    it without making a tensor from host data.
    """

    row: int
    items: tuple[VisualItem, ...]
    separators: tuple[int, ...]  # absolute prior slot of each item
    stages: dict[int, int]
    positions: torch.Tensor
    item_of: torch.Tensor
    offset: torch.Tensor
    row_index: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.positions.numel())

    def kept(self, positions: torch.Tensor, item_of: torch.Tensor, offset: torch.Tensor) -> Pool:
        """The pool of the surviving tokens, given as their positions, items and offsets (ascending)."""
        return replace(self, positions=positions, item_of=item_of, offset=offset)


def make_pools(
    items: Sequence[VisualItem],
    schedule: Callable[[int, tuple[int, int] | None], list[tuple[int, int]]],
    multi_image: str,
    separator_offset: int,
) -> list[Pool]:
    """Group ``items`` (prompt order) into pools, each with its stages.

    ``schedule(n, part)`` returns the (layer, kept) stages of a pool of ``n`` tokens; ``part`` is
    (tokens of the row's items before it, the row's visual tokens) when a count budget is split.
    """
    rows: dict[int, list[VisualItem]] = {}
    for item in items:
        rows.setdefault(item.row, []).append(item)
    pools = []
    for row, row_items in rows.items():
        groups = [row_items] if multi_image == "global" else [[item] for item in row_items]
        total = sum(item.size for item in row_items)
        before = 0
        for group in groups:
            size = sum(item.size for item in group)
            part = None if len(groups) == 1 else (before, total)
            before += size
            device = group[0].positions.device
            pools.append(
                Pool(
                    row=row,
                    items=tuple(group),
                    separators=tuple(item.separator + separator_offset for item in group),
                    stages=dict(schedule(size, part)),
                    positions=torch.cat([item.positions for item in group]),
                    item_of=torch.cat(
                        [torch.full((item.size,), i, device=device) for i, item in enumerate(group)]
                    ),
                    offset=torch.cat([torch.arange(item.size, device=device) for item in group]),
                    row_index=torch.tensor([row], device=device),
                )
            )
    return pools


TENSOR_FIELDS = ("positions", "item_of", "offset", "row_index")
"""The fields of a ``Pool`` that hold tensors (moved to the model's device with the plan)."""
