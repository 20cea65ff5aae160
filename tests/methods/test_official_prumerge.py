"""LLaVA-PruMerge and PruMerge+ through the public API against the authors' code, on the tiny
576-token LLaVA.

Authors' code: github.com/42Shawn/LLaVA-PruMerge at 097c04116a58465e4bcb58cec44a94018a68ff1a,
``llava/model/multimodal_encoder/clip_encoder.py`` (``token_prune_merge_advanced`` = PruMerge,
``token_prune_merge_advanced_plus`` = PruMerge+, ``outlier_dectection``, ``complement_idx``).
Restated for the test:

* [CLS] attention: forward hooks on ``layers[23].self_attn.{q,k}_proj`` (the *last* layer of the
  24-layer tower), one softmax of ``q @ k^T * C ** -0.5`` over all heads concatenated (C the feature
  width, 1024), row 0 over the patches: ``cls_attn = attn[:, 0, 1:]``;
* adaptive count: the share of ``cls_attn`` above Q3 + 1.5 IQR (``np.percentile``), ``int(N * ratio)``
  tokens by ``topk``; PruMerge+ adds ``torch.arange(0, 575, int(int(1 / ratio) / 3))`` minus the tokens
  already kept;
* merge, on the penultimate layer's patch features (``hidden_states[-2][:, 1:]``, before the
  projector): each kept token i becomes ``x_i + sum_j a_j x_j`` over the 32 other tokens (kept or not)
  whose last-layer keys are most cosine-similar to its own, ``a_j`` their [CLS] attention, unnormalised;
  one extra token ``sum_j a_j x_j`` over the pruned tokens is appended (no slot in this harness).
* ``if_adaptive=False`` (the authors' fixed ``reduction_ratio``; the harness's fixed budget K) keeps
  the top K by the same attention with the same merge.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers.official_vision import (
    N_VISUAL,
    Tower,
    one_image,
    overlap,
    pruned_run,
    tiny_llava_576,
    tower_tensors,
)


def official_cls_attention(tower: Tower) -> torch.Tensor:
    q, k = tower.q[-1], tower.k[-1]  # last layer, [T, C]
    width = tower.hidden[-2].shape[-1]
    attn = torch.softmax(q @ k.T * width**-0.5, dim=-1)
    return attn[0, 1:]  # [N]


def outlier_ratio(cls: torch.Tensor) -> float:
    values = cls.to(dtype=torch.float32).numpy().flatten()  # as the authors
    q1, q3 = np.percentile(values, 25), np.percentile(values, 75)
    return len(np.where(values > q3 + 1.5 * (q3 - q1))[0]) / len(values)


def official_prumerge(tower: Tower, plus: bool, budget: int | None = None, cls: torch.Tensor | None = None):
    """(kept indices in the authors' order, merged pre-projector features [K, C], extra token [C]);
    ``budget`` None is the adaptive path (the authors' default), else the top ``budget``."""
    features = tower.hidden[-2][1:]  # [N, C]
    n = features.shape[0]
    cls = official_cls_attention(tower) if cls is None else cls
    if budget is None:
        ratio = outlier_ratio(cls)
        idx = torch.topk(cls, int(n * ratio)).indices
        if plus:
            step_length = int(1 / ratio)
            grid = torch.arange(0, 575, int(step_length / 3))
            filtered = torch.tensor([x for x in grid.tolist() if x not in idx.tolist()], dtype=torch.long)
            idx = torch.cat([idx, filtered])
    else:
        idx = torch.topk(cls, budget).indices
    keys = F.normalize(tower.k[-1][1:], p=2, dim=-1)  # [N, C] last layer, without [CLS]
    taken = torch.zeros(n, dtype=torch.bool)
    taken[idx] = True
    compl = torch.arange(n)[~taken]
    updated = []
    for i, token in enumerate(idx.tolist()):
        rest = torch.cat([idx[:i], idx[i + 1 :], compl])
        similarity = keys[token] @ keys[rest].T
        near = rest[torch.topk(similarity, k=32).indices]
        updated.append(features[token] + (cls[near, None] * features[near]).sum(dim=0))
    extra = (cls[compl, None] * features[compl]).sum(dim=0)
    return idx, torch.stack(updated), extra


@pytest.fixture(scope="module")
def setting():
    model = tiny_llava_576()
    batch = one_image(model)
    return model, batch, tower_tensors(model, batch)


def _compare(model, batch, tower, idx, updated, budget, **options):
    order = idx.argsort()
    expected_kept = idx[order]
    got = pruned_run(model, batch, "prumerge", budget, **options)
    assert torch.equal(got.kept, expected_kept), f"overlap {overlap(got.kept, expected_kept):.2f}"
    with torch.no_grad():
        expected = tower.project(updated[order])
    torch.testing.assert_close(got.embeddings, expected, atol=1e-8, rtol=0)


@pytest.mark.parametrize("plus", [False, True])
def test_adaptive_keeps_and_merges_as_the_authors(setting, plus):
    model, batch, tower = setting
    idx, updated, _ = official_prumerge(tower, plus)
    assert 0 < idx.numel() < N_VISUAL
    _compare(model, batch, tower, idx, updated, 64, adaptive=True, plus=plus)


@pytest.mark.parametrize("budget", [32, 64])
def test_fixed_budget_keeps_and_merges_as_the_authors(setting, budget):
    model, batch, tower = setting
    idx, updated, _ = official_prumerge(tower, plus=False, budget=budget)
    _compare(model, batch, tower, idx, updated, budget)


def test_negative_control_penultimate_head_mean_attention_differs(setting):
    """The library's earlier [CLS] attention (head mean at the penultimate layer) ranks otherwise."""
    _, _, tower = setting
    wrong = tower.attentions[-2][:, 0, 1:].mean(dim=0)
    right = official_cls_attention(tower)
    top_right = set(torch.topk(right, 64).indices.tolist())
    top_wrong = set(torch.topk(wrong, 64).indices.tolist())
    assert top_right != top_wrong
