"""Evidence layout on hand-made prompts and attention: which recomputed row is each image's prior,
which rows form the posterior, and how a pool of two images normalises its prior."""

from __future__ import annotations

import pytest
import torch

import priortr
from priortr.adapters.base import VisualItem
from priortr.engine.evidence import per_item_prior
from priortr.engine.plan import pool_rows
from priortr.engine.pools import Pool
from tests.helpers.tiny import llava_batch, tiny_llava
from tests.helpers.tiny_qwen3_vl import qwen3_vl_batch, tiny_qwen3_vl


def _pool(items: list[VisualItem]) -> Pool:
    return Pool(
        row=0,
        items=tuple(items),
        separators=tuple(item.separator for item in items),
        stages={1: 2},
        positions=torch.cat([item.positions for item in items]),
        item_of=torch.cat([torch.full((item.size,), i) for i, item in enumerate(items)]),
        offset=torch.cat([torch.arange(item.size) for item in items]),
        row_index=torch.tensor([0]),
    )


# Prompt: 0 text, 1-2 image A, 3 separator A, 4 text, 5-6 image B, 7 separator B, 8-9 question.
ROWS = [3, 4, 7, 8, 9]  # recomputed rows (text from the first separator on); the layout pads to WIDTH
WIDTH = 6


def test_one_image_reads_its_own_separator_and_the_rows_after_it():
    image_b = _pool([VisualItem(0, torch.tensor([5, 6]), 7)])
    rows = pool_rows(image_b, ROWS, WIDTH, "after_separator")
    assert rows.prior.tolist() == [2]  # the row of position 7
    assert rows.posterior.tolist() == [False, False, False, True, True, False]
    assert rows.last == 4  # position 9
    # SparseVLM's rater candidates: the text from the separator on, whatever posterior_rows says.
    assert rows.after.tolist() == [False, False, True, True, True, False]
    image_a = _pool([VisualItem(0, torch.tensor([1, 2]), 3)])
    assert pool_rows(image_a, ROWS, WIDTH, "last").after.tolist() == [True] * 5 + [False]
    assert pool_rows(image_b, ROWS, WIDTH, "from_separator").posterior.tolist() == [
        False,
        False,
        True,
        True,
        True,
        False,
    ]
    assert pool_rows(image_b, ROWS, WIDTH, "last").posterior.tolist() == [
        False,
        False,
        False,
        False,
        True,
        False,
    ]
    # The authors' Qwen rows: the separator to the token before the last (positions 7, 8).
    assert pool_rows(image_b, ROWS, WIDTH, "from_separator_except_last").posterior.tolist() == [
        False,
        False,
        True,
        True,
        False,
        False,
    ]


def test_two_images_in_one_pool_read_each_separator_and_the_rows_after_the_last():
    pool = _pool([VisualItem(0, torch.tensor([1, 2]), 3), VisualItem(0, torch.tensor([5, 6, 7]), 8)])
    rows = pool_rows(pool, [3, 4, 8, 9], 5, "after_separator")
    assert rows.prior.tolist() == [0, 2]
    assert rows.posterior.tolist() == [False, False, False, True, False], "P: rows after the last separator"


def test_two_images_in_one_pool_normalise_each_prior_by_its_share():
    raw = torch.rand(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # [H, n]
    item_of = torch.tensor([0, 0, 1, 1, 1])
    prior = per_item_prior(raw, item_of, 2)
    raw_a, raw_b = raw[:, :2], raw[:, 2:]
    expected = torch.cat(
        [raw_a / raw_a.sum(-1, keepdim=True) * 2 / 5, raw_b / raw_b.sum(-1, keepdim=True) * 3 / 5], -1
    )
    torch.testing.assert_close(prior, expected)


def test_the_text_after_an_image_starts_at_its_separator():
    image_b = _pool([VisualItem(0, torch.tensor([5, 6]), 7)])
    assert pool_rows(image_b, ROWS, WIDTH, "after_separator").after.tolist() == [
        False,
        False,
        True,
        True,
        True,
        False,
    ]


@pytest.mark.parametrize(
    ("build", "make_batch", "scored"),
    [(tiny_llava, llava_batch, 0), (tiny_qwen3_vl, qwen3_vl_batch, 1)],
    ids=["llava", "qwen3-vl (q/k norms)"],
)
def test_next_layer_attention_is_that_layers_own_attention(build, make_batch, scored):
    """``next_attention`` at a stage scored at layer l: the attention weights layer l + 1 computes when
    it runs (eager, unpruned model), instruction rows over the visual tokens; layer l's differ."""
    model = build(attn="eager")
    batch = make_batch(model, 1)
    with torch.no_grad():
        attentions = model(**batch.kwargs(), output_attentions=True).attentions
    visual = batch.visual_mask()[0]
    after = torch.arange(batch.seq_len) > int(visual.nonzero().max())  # the separator on: the default P

    def posterior(layer):
        rows = attentions[layer][0].mean(dim=0)[after][:, visual].mean(dim=0)
        return rows / rows.sum()

    with priortr.apply(model, method="pdrop", stages=[(scored, 4)]) as handle, torch.no_grad():
        model(**batch.kwargs())
    torch.testing.assert_close(handle.last.posterior[0].double(), posterior(scored + 1), atol=1e-7, rtol=0)
    assert (handle.last.posterior[0].double() - posterior(scored)).abs().max() > 1e-5
