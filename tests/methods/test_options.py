"""Every method with each of its documented options runs end to end on a tiny model, or ``apply()``
refuses the option before any forward pass: an option is never accepted and then broken at the first
forward (``priortr+merge`` with ``adaptive=True``, the paper's merging setting, was)."""

from __future__ import annotations

import re

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
    "cutoff": [0.3],
    "temperature": [1.0],
}
CASES = [(method, {}) for method in priortr.available_methods()] + [
    (method, {knob: value})
    for method in priortr.available_methods()
    for knob in priortr.get_method(method).knobs
    for value in ALTERNATIVES.get(knob, [])
]


# a value outside every knob's range, and the selector's own words for it
BAD_VALUES: dict[str, tuple[object, str]] = {
    "adaptive": ("yes", "must be True or False, got 'yes'"),
    "plus": (1, "must be True or False, got 1"),
    "cls_takes_a_slot": (None, "must be True or False, got None"),
    "recycling": ("sometimes", "must be one of ['on_top', 'in_budget'], got 'sometimes'"),
    "clustering": ("dbscan", "must be one of"),
    "recycle_ratio": (2, "must be in (0, 1], got 2"),
    "tokens_per_cluster": (0, "must be an int >= 1, got 0"),
    "neighbours": (0, "must be an int >= 1, got 0"),
    "contextual_ratio": (1.5, "must be in [0, 1], got 1.5"),
    "important_ratio": (-0.1, "must be in [0, 1], got -0.1"),
    "step": (2.5, "must be an int >= 1, got 2.5"),
    "image_pivots": (0, "must be an int >= 1, got 0"),
    "text_pivots": (-1, "must be an int >= 0, got -1"),
    "cutoff": (0, "must be a positive number; got 0"),
    "temperature": (float("nan"), "must be a positive number; got nan"),
}
BAD_CASES = [
    (method, knob) for method in priortr.available_methods() for knob in priortr.get_method(method).knobs
]


def test_every_knob_has_its_alternatives_listed():
    knobs = {knob for method in priortr.available_methods() for knob in priortr.get_method(method).knobs}
    assert knobs == set(ALTERNATIVES) == set(BAD_VALUES)


@pytest.mark.parametrize(("method", "knob"), BAD_CASES, ids=[f"{m}-{k}" for m, k in BAD_CASES])
def test_a_bad_option_value_is_refused_by_apply_before_any_forward(llava, method, knob):
    """Before: ``apply`` checked only the option's name, and the value failed at the first forward
    (DART ``image_pivots=0``, ``recycle_ratio=2``); the message is the selector's, as the CLI shows it."""
    model, _ = llava
    value, message = BAD_VALUES[knob]
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match=re.escape(f"{knob} {message}")):
            priortr.apply(model, method=method, budget=8, options={knob: value})
    finally:
        hook.remove()
    assert not calls and priortr.detach(model) is False  # refused before anything ran or attached


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
