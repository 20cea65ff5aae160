"""DivPrune through the public API against the authors' algorithm, on the tiny 576-token LLaVA.

Authors' code: github.com/vbdi/divprune at 799e2d950aa01ba7860907f5a6d86061f885dca6,
``LLaVA/llava/model/llava_arch.py`` (``DivPrune``, ``pairwise_cosine_similarity`` and the
``LAYER_INDEX=0`` branch of ``prepare_inputs_labels_for_multimodal``). Restated here for the test:
on the language model's input embeddings of the visual tokens, d = 1 - cosine; the first pick is the
column whose second-smallest distance (the smallest being its own, 0) is largest; every next pick is
the column whose smallest distance to the picks so far is largest (``torch.argmax``: first maximum).
The authors' ratio ``SUBSET_RATIO`` (0.098 published) is the budget K = round(ratio * N) here.
"""

from __future__ import annotations

import pytest
import torch

import priortr
from priortr.methods.selection import StageInputs
from tests.helpers.official_vision import one_image, overlap, pruned_run, tiny_llava_576, tower_tensors


def official_divprune(embeddings: torch.Tensor, budget: int) -> list[int]:
    """The authors' picks, in pick order (an index may repeat, as in their code)."""
    unit = embeddings / embeddings.norm(dim=1, keepdim=True)
    distance = 1.0 - unit @ unit.T
    picks: list[int] = []
    for i in range(budget):
        if i == 0:
            scores = torch.topk(distance, 2, dim=0, largest=False).values[1, :]
        else:
            scores = distance[picks].min(dim=0).values
        picks.append(int(torch.argmax(scores)))
    return picks


@pytest.fixture(scope="module")
def setting():
    model = tiny_llava_576()
    batch = one_image(model)
    tower = tower_tensors(model, batch)
    with torch.no_grad():
        embeddings = tower.project(tower.hidden[-2][1:])  # [576, D] the LLM's input embeddings
    return model, batch, embeddings


@pytest.mark.parametrize("budget", [32, 56, 128])
def test_default_keeps_the_authors_tokens(setting, budget):
    model, batch, embeddings = setting
    expected = torch.tensor(sorted(official_divprune(embeddings, budget)))
    assert expected.unique().numel() == budget  # no repeat on real features
    got = pruned_run(model, batch, "divprune", budget)
    assert torch.equal(got.kept, expected), f"overlap {overlap(got.kept, expected):.2f}"
    torch.testing.assert_close(got.embeddings, embeddings[got.kept], atol=1e-10, rtol=0)


def test_negative_control_first_pick_by_mean_distance_differs(setting):
    """A perturbed reference (first pick by the largest mean distance) keeps another set."""
    _, _, embeddings = setting
    unit = embeddings / embeddings.norm(dim=1, keepdim=True)
    distance = 1.0 - unit @ unit.T
    picks = [int(torch.argmax(distance.mean(dim=0)))]
    for _ in range(31):
        picks.append(int(torch.argmax(distance[picks].min(dim=0).values)))
    assert sorted(picks) != sorted(official_divprune(embeddings, 32))


def test_documented_deviation_never_picks_a_token_twice():
    """With exact duplicates left, the authors' argmax can re-pick a chosen token (its own distance, a
    rounding error above 0, beats the duplicates' 0); the library keeps K distinct tokens instead."""
    base = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    hidden = torch.cat([base, base, base])  # every token has two exact duplicates
    official = official_divprune(hidden, 5)
    selection = priortr.get_method("divprune").select(StageInputs(budget=5, hidden=hidden[None]))
    assert selection.indices.shape == (1, 5) and selection.indices[0].unique().numel() == 5
    assert len(set(official)) < 5, official  # the authors' code repeats a pick here
