"""VisionZip through the public API against the authors' algorithm, on the tiny 576-token LLaVA.

Authors' code: github.com/dvlab-research/VisionZip at 3151f6df4fca36a4cd1c985e5956e725b1f9ad02,
``visionzip/clip_encoder.py`` (``CLIPVisionTower_VisionZip.forward``), ``visionzip/utils.py``
(``CLIPAttention_forward`` returns ``raw_key_states.mean(1)``; ``apply_info`` keeps it only at
layer 22 of 24, ``r = [0] * 22 + [1] + [0]``), ``visionzip/main.py`` (``dominant_num = dominant - 1``)
and README (``visionzip(model, dominant=54, contextual=10)`` for 64 tokens). Restated for the test:

* the feature layer (``attentions[-2]``, the penultimate) ranks patches by its [CLS] row summed over
  heads; [CLS] plus the top ``dominant - 1`` patches are the dominant tokens (so 53 patches for 64);
* the remaining patches, in sequence order, are split into ``contextual`` targets (every
  ``R // contextual``-th, the first ``contextual`` of them) and the others; each other patch joins the
  target whose head-mean key (the feature layer's ``k_proj``, heads averaged) is most cosine-similar;
* a contextual token is ``target + mean(joined)`` (``target`` alone when none joined), on the
  tower's features before the projector, which then maps every kept token.

The language model here has no slot for [CLS]: the harness keeps the 53 + 10 patch tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.official_vision import Tower, one_image, overlap, pruned_run, tiny_llava_576, tower_tensors


def official_visionzip(tower: Tower, dominant: int, contextual: int, target_plus_mean: bool = True):
    """(kept patch indices ascending, their pre-projector features) as the authors' code builds them."""
    hidden = tower.hidden[-2]  # [T, C], [CLS] first
    tokens = hidden.shape[0]
    metric = tower.k[-2].view(tokens, tower.heads, -1).mean(dim=1)  # [T, d]
    cls_sum = tower.attentions[-2][:, 0, 1:].sum(dim=0)  # [N]
    topk = cls_sum.topk(dominant - 1).indices + 1
    all_indices = torch.cat([torch.zeros(1, dtype=topk.dtype), topk])
    rest = torch.ones(tokens, dtype=torch.bool).scatter_(0, all_indices, False)  # True: not dominant
    rest_index = torch.arange(tokens)[rest]  # [R] token indices, ascending
    normalized = metric[rest] / metric[rest].norm(dim=-1, keepdim=True)
    step = max(1, normalized.shape[0] // contextual)
    targets = torch.arange(0, normalized.shape[0], step)[:contextual]
    is_target = torch.isin(torch.arange(normalized.shape[0]), targets)
    similarity = normalized[~is_target] @ normalized[targets].T
    assignment = similarity.argmax(dim=1)[:, None]
    one_hot = torch.zeros(similarity.shape, dtype=hidden.dtype).scatter_(1, assignment, 1)
    counts = one_hot.sum(dim=0).clamp(min=1)[:, None]
    aggregated = one_hot.T @ hidden[rest][~is_target] / counts
    if target_plus_mean:
        contextual_tokens = hidden[rest][targets] + aggregated
    else:  # the library's earlier rule: the mean over the target and the tokens that joined it
        joined = one_hot.sum(dim=0)[:, None]
        contextual_tokens = (hidden[rest][targets] + aggregated * joined) / (1 + joined)
    patches = torch.cat([topk - 1, rest_index[targets] - 1])
    features = torch.cat([hidden[topk], contextual_tokens])
    order = patches.argsort()
    return patches[order], features[order]


@pytest.fixture(scope="module")
def setting():
    model = tiny_llava_576()
    batch = one_image(model)
    tower = tower_tensors(model, batch)
    return model, batch, tower


def test_default_at_64_keeps_and_merges_as_the_authors(setting):
    model, batch, tower = setting
    kept, features = official_visionzip(tower, dominant=54, contextual=10)
    assert kept.numel() == 63  # 53 dominant patches + 10 contextual; [CLS] is the 64th
    got = pruned_run(model, batch, "visionzip", 64)
    assert torch.equal(got.kept, kept), f"overlap {overlap(got.kept, kept):.2f}"
    with torch.no_grad():
        expected = tower.project(features)
    torch.testing.assert_close(got.embeddings, expected, atol=1e-8, rtol=0)


def test_negative_control_mean_of_target_and_joined_differs(setting):
    """The library's earlier merge (mean over target and joined) gives other contextual tokens."""
    _, _, tower = setting
    _, right = official_visionzip(tower, 54, 10)
    _, wrong = official_visionzip(tower, 54, 10, target_plus_mean=False)
    assert (right - wrong).abs().max() > 1e-3
