"""Every method with each of its documented options runs end to end on a tiny model, or ``apply()``
refuses the option before any forward pass: an option is never accepted and then broken at the first
forward (``priortr+merge`` with ``adaptive=True``, the paper's merging setting, was)."""

from __future__ import annotations

import pytest
import torch

import priortr
from priortr.methods.clustering import CLUSTERINGS
from priortr.methods.sparsevlm import RECYCLING
from tests.helpers.families import setup
from tests.helpers.pruned import NEW_TOKENS, generate

# the other documented values of every knob (docs/methods.md; bools: the other one)
ALTERNATIVES: dict[str, list[object]] = {
    "adaptive": [True],
    "plus": [True],
    "cls_takes_a_slot": [False],
    "recycling": list(RECYCLING),
    "clustering": list(CLUSTERINGS),
    "recycle_ratio": [1.0],
    "tokens_per_cluster": [1],
    "neighbours": [4],
    "contextual_ratio": [0.5],
    "important_ratio": [0.25],
    "step": [2],
    "image_pivots": [2],
    "text_pivots": [1],
}
CASES = [(method, {}) for method in priortr.available_methods()] + [
    (method, {knob: value})
    for method in priortr.available_methods()
    for knob in priortr.get_method(method).knobs
    for value in ALTERNATIVES.get(knob, [])
]


def test_every_knob_has_its_alternatives_listed():
    knobs = {knob for method in priortr.available_methods() for knob in priortr.get_method(method).knobs}
    assert knobs == set(ALTERNATIVES)


@pytest.fixture(scope="module")
def llava():
    return setup("llava", 1)


@pytest.mark.parametrize(("method", "options"), CASES, ids=[f"{m}-{o}" for m, o in CASES])
def test_each_documented_option_runs(llava, method, options):
    model, batch = llava
    with priortr.apply(model, method=method, budget=8, options=options) as handle, torch.no_grad():
        out = generate(model, batch)
    assert out.sequences.shape == (1, batch.seq_len + NEW_TOKENS)
    assert handle.last is not None and 1 <= int((handle.last.kept >= 0).sum()) < batch.n_visual
