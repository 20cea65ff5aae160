"""``priortr.evidence.pool_attention`` on hand-made attention rows: which row is each token's prior,
which rows form the posterior, and how a pool of two images normalises its prior."""

from __future__ import annotations

import torch

from priortr.adapters.base import VisualItem
from priortr.evidence import pool_attention
from priortr.pools import Pool


def _pool(items: list[VisualItem]) -> Pool:
    return Pool(
        row=0,
        items=tuple(items),
        separators=tuple(item.separator for item in items),
        stages={1: 2},
        positions=torch.cat([item.positions for item in items]),
        item_of=torch.cat([torch.full((item.size,), i) for i, item in enumerate(items)]),
        offset=torch.cat([torch.arange(item.size) for item in items]),
    )


# Prompt: 0 text, 1-2 image A, 3 separator A, 4 text, 5-6 image B, 7 separator B, 8-9 question.
ROWS = torch.tensor(
    [3, 4, 7, 8, 9, -1]
)  # recomputed rows (text from the first separator on), one padding row
ATTENTION = torch.arange(1, 1 + 6 * 10, dtype=torch.float64).view(1, 6, 10)  # [H=1, R=6, S=10], distinct


def test_one_image_reads_its_own_separator_and_the_rows_after_it():
    image_b = VisualItem(0, torch.tensor([5, 6]), 7)
    piece = pool_attention(ATTENTION, ROWS, torch.tensor([5, 6]), _pool([image_b]), 9, "after_separator")
    torch.testing.assert_close(piece.prior, ATTENTION[:, 2, [5, 6]])  # row of position 7
    assert piece.valid.tolist() == [False, False, False, True, True, False]
    torch.testing.assert_close(piece.last, ATTENTION[:, 4, [5, 6]])
    from_separator = pool_attention(
        ATTENTION, ROWS, torch.tensor([5, 6]), _pool([image_b]), 9, "from_separator"
    )
    assert from_separator.valid.tolist() == [False, False, True, True, True, False]
    last = pool_attention(ATTENTION, ROWS, torch.tensor([5, 6]), _pool([image_b]), 9, "last")
    assert last.valid.tolist() == [False, False, False, False, True, False]


def test_two_images_in_one_pool_normalise_each_prior_by_its_share():
    image_a, image_b = VisualItem(0, torch.tensor([1, 2]), 3), VisualItem(0, torch.tensor([5, 6, 7]), 8)
    rows = torch.tensor([3, 4, 8, 9, -1])
    attention = torch.rand(2, 5, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    columns = torch.tensor([1, 2, 5, 6, 7])
    piece = pool_attention(attention, rows, columns, _pool([image_a, image_b]), 9, "after_separator")
    raw_a, raw_b = attention[:, 0, [1, 2]], attention[:, 2, [5, 6, 7]]  # each image's own separator row
    expected = torch.cat(
        [raw_a / raw_a.sum(-1, keepdim=True) * 2 / 5, raw_b / raw_b.sum(-1, keepdim=True) * 3 / 5], -1
    )
    torch.testing.assert_close(piece.prior, expected)
    assert piece.valid.tolist() == [False, False, False, True, False], "P: rows after the last separator"
