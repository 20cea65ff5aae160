"""PriorTR keeps the tokens its authors' code keeps: the default on LLaVA-1.5, the named variant on Qwen.

Reference: CodeChildCZJ/PriorTR at e442a4c14af1b333067a6b8310c9111cad922033, restated here:

* ``image/LLaVA/llava/vtr/strategy/priortr.py`` (``PriorTRStrategy.compute_scores``, LLaVA-1.5's
  ``query_aggregation='question'``): Q = ``attention[:, :, img_end, img_start:img_end]`` (the separator's
  row), P = ``attention[:, :, img_end:, img_start:img_end].mean(dim=2)`` (rows i_e .. T-1, averaged
  before the heads), both head-mean, cast to float32, normalised as ``x / (x.sum() + eps)`` and scored
  ``P * log((P + eps) / (Q + eps))`` with eps = 1e-10; ``base.py`` ``select_tokens`` keeps
  ``scores.topk(k).indices.sort()``.
* ``image/Qwen2-VL/visual_token_pruning/strategy/priortr.py`` (byte-identical in ``image/Qwen3-VL/``):
  the same, except P = ``attention[:, :, question_start:-1, ...]`` with ``question_start = img_end``
  (rows i_e .. T-2), falling back to the last row when ``question_start >= seq_len - 1``.

The port reads the stock model's own eager attention weights at the scored layer (causal, as the
paper's premise requires: the authors' Qwen capture adds no causal mask for an unpadded batch-1
prefill under sdpa / FlashAttention-2, a deviation not reproduced, docs/methods.md). The library is
driven through ``priortr.apply`` only: ``priortr.apply(model)`` (the paper's rows j >= i_e) against the
LLaVA code, ``posterior_rows='from_separator_except_last'`` against the Qwen code. The posterior P is
compared too: on these random-weight models the row choices often keep the same set (the scores of
16 near-uniform tokens), but P itself tells them apart.
"""

from __future__ import annotations

import pytest
import torch

import priortr
from tests.helpers.tiny import llava_batch, qwen_batch, tiny_llava, tiny_qwen2_vl
from tests.helpers.tiny_qwen3_vl import tiny_qwen3_vl

LAYER = 2  # the library's default scored layer for priortr; the authors' prune_layer = 3
AUTHORS_EPS = 1e-10


def authors_priortr(attention: torch.Tensor, img_start: int, img_end: int, rows: str, keep: int):
    """The authors' PriorTR on one prompt's attention [H, T, T] at the scored layer: (P, kept positions).

    ``rows``: ``'llava'`` (``img_end:``) or ``'qwen'`` (``img_end:-1``, the last row when none)."""
    seq_len = attention.shape[-1]
    q = attention[None, :, img_end, img_start:img_end]  # [1, H, N]
    if rows == "llava":
        p = attention[None, :, img_end:, img_start:img_end].mean(dim=2)
    elif img_end >= seq_len - 1:
        p = attention[None, :, -1, img_start:img_end]
    else:
        p = attention[None, :, img_end:-1, img_start:img_end].mean(dim=2)
    p, q = p.mean(dim=1).squeeze(0).float(), q.mean(dim=1).squeeze(0).float()
    p = p / (p.sum() + AUTHORS_EPS)
    q = q / (q.sum() + AUTHORS_EPS)
    scores = p * torch.log((p + AUTHORS_EPS) / (q + AUTHORS_EPS))
    kept = scores.topk(keep).indices.sort().values + img_start
    return p, kept.tolist()


FAMILIES = {
    "llava": (tiny_llava, lambda model, seed, after: llava_batch(model, 1, seed=seed, text_after=(after,))),
    "qwen2-vl": (
        tiny_qwen2_vl,
        lambda model, seed, after: qwen_batch(model, 1, (1, 8, 8), seed, text_after=(after,)),
    ),
    "qwen3-vl": (
        tiny_qwen3_vl,
        lambda model, seed, after: qwen_batch(model, 1, (1, 8, 8), seed, text_after=(after,)),
    ),
}
"""Each family's eager float64 model and a one-image prompt with ``after`` tokens after its separator
(16 visual tokens)."""


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    build, make_batch = FAMILIES[request.param]
    return request.param, build(attn="eager"), make_batch


def _reference(model, batch, rows: str, keep: int):
    with torch.no_grad():
        attention = model(**batch.kwargs(), output_attentions=True).attentions[LAYER][0]  # [H, T, T]
    return authors_priortr(attention, batch.image_start[0], batch.image_end[0], rows, keep)


def _library(model, batch, keep: int, **settings):
    with priortr.apply(model, budget=keep, **settings) as handle, torch.no_grad():
        model(**batch.kwargs())
    assert [stage.layer for stage in handle.last.stages] == [LAYER]
    return handle.last.posterior[0], handle.last.kept[0].tolist()


@pytest.mark.parametrize("after", [2, 6], ids=["short", "long"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_default_is_the_authors_llava_rows(family, seed, after):
    """The default posterior (rows j >= i_e) is the authors' LLaVA-1.5 rule, on every family."""
    _, model, make_batch = family
    batch = make_batch(model, seed, after)
    for keep in (4, 8):
        posterior, kept = _library(model, batch, keep)
        reference_p, reference_kept = _reference(model, batch, "llava", keep)
        torch.testing.assert_close(posterior, reference_p, rtol=1e-5, atol=1e-8)
        assert kept == reference_kept


@pytest.mark.parametrize("after", [2, 3, 6])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_from_separator_except_last_is_the_authors_qwen_rows(family, seed, after):
    """``posterior_rows='from_separator_except_last'`` is the authors' Qwen2-VL / Qwen3-VL rule."""
    _, model, make_batch = family
    batch = make_batch(model, seed, after)
    for keep in (4, 8):
        posterior, kept = _library(model, batch, keep, posterior_rows="from_separator_except_last")
        reference_p, reference_kept = _reference(model, batch, "qwen", keep)
        torch.testing.assert_close(posterior, reference_p, rtol=1e-5, atol=1e-8)
        assert kept == reference_kept


def test_a_short_instruction_tells_the_row_choices_apart(family):
    """Negative controls, two tokens after the separator: the former default (``after_separator``) is
    not the authors' LLaVA P, the default is not the authors' Qwen P, and the default keeps another set
    than the authors' Qwen code in some of 6 trials (seeds 0-2, K = 4 and 8)."""
    _, model, make_batch = family
    different_sets = 0
    for seed in range(3):
        batch = make_batch(model, seed, 2)
        for keep in (4, 8):
            llava_p, _ = _reference(model, batch, "llava", keep)
            qwen_p, qwen_kept = _reference(model, batch, "qwen", keep)
            former, _ = _library(model, batch, keep, posterior_rows="after_separator")
            default, kept = _library(model, batch, keep)
            assert ((former - llava_p).abs() / llava_p).max() > 1e-3
            assert ((default - qwen_p).abs() / qwen_p).max() > 1e-3
            different_sets += kept != qwen_kept
    assert different_sets >= 1
