"""VisPruner through the public API against the authors' algorithm, on the tiny 576-token LLaVA.

Authors' code: github.com/Theia-4869/VisPruner at aefa01adc7c7ce6334e880c88225e90cede760d1,
``llava/model/llava_arch.py`` (``encode_images``) and ``llava/model/multimodal_encoder/clip_encoder.py``
(``feature_select``). Restated here for the test (not the library's selector): the [CLS] row of the
feature layer's attention (``attentions[select_layer]``, the penultimate layer), averaged over heads,
ranks the tokens; the top ``int(T * important_ratio)`` are important; the rest, in that order, lose
``min(8, R - T_div)`` tokens per round, the even-position tokens most similar (cosine) to an odd-position
token, until T_div remain; similarity is on the tower's features *before* the projector
(``hidden_states[select_layer][:, 1:]``). The authors' ``argsort`` is not stable; a stable sort is used
here, which differs only on exact float ties.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.official_vision import (
    N_VISUAL,
    Tower,
    one_image,
    overlap,
    pruned_run,
    tiny_llava_576,
    tower_tensors,
)


def official_vispruner(
    scores: torch.Tensor, features: torch.Tensor, budget: int, important_ratio: float = 0.5
) -> torch.Tensor:
    """The authors' selection for one image: ``scores`` [N] head-mean [CLS] attention, ``features`` [N, C]."""
    important_num = int(budget * important_ratio)
    diverse_num = budget - important_num
    order = torch.sort(scores, descending=True, stable=True).indices
    important, residual = order[:important_num], order[important_num:]
    normalized = features / features.norm(dim=-1, keepdim=True)
    while diverse_num > 0:
        r = min(8, residual.numel() - diverse_num)
        if r <= 0:
            break
        a, b = normalized[residual[::2]], normalized[residual[1::2]]
        duplication = (a @ b.T).max(dim=-1).values
        distinct = torch.sort(duplication, descending=True, stable=True).indices[r:]
        residual = torch.cat([residual[::2][distinct], residual[1::2]])
    return torch.cat([important, residual]).sort().values


def cls_scores(tower: Tower) -> torch.Tensor:
    return tower.attentions[-2][:, 0, 1:].mean(dim=0)  # feature layer = penultimate


@pytest.fixture(scope="module")
def setting():
    model = tiny_llava_576()
    batch = one_image(model)
    return model, batch, tower_tensors(model, batch)


@pytest.mark.parametrize("budget", [32, 64, 128])
def test_default_keeps_the_authors_tokens(setting, budget):
    model, batch, tower = setting
    features = tower.hidden[-2][1:]  # [576, C] before the projector
    expected = official_vispruner(cls_scores(tower), features, budget)
    got = pruned_run(model, batch, "vispruner", budget)
    assert got.kept.numel() == budget
    assert torch.equal(got.kept, expected), f"overlap {overlap(got.kept, expected):.2f}"
    with torch.no_grad():  # plain pruning: the language model sees the projected features unchanged
        torch.testing.assert_close(got.embeddings, tower.project(features[got.kept]), atol=1e-10, rtol=0)


def test_negative_control_projector_outputs_give_another_set(setting):
    """De-duplicating the projector's outputs (the library's earlier behaviour) keeps other tokens."""
    tower = setting[2]
    features = tower.hidden[-2][1:]
    with torch.no_grad():
        projected = tower.project(features)
    budget = 64
    right = official_vispruner(cls_scores(tower), features, budget)
    wrong = official_vispruner(cls_scores(tower), projected, budget)
    assert not torch.equal(right, wrong)
    assert features.shape[0] == N_VISUAL
