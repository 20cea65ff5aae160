"""DART's selector on hand-made keys and states, and the Python-set order it visits its pivots in.

End to end against the authors' algorithm: tests/methods/test_official_dart.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from priortr.methods.dart import dart
from priortr.methods.selection import Selection, StageInputs
from priortr.methods.setorder import set_order


def _at_angles(*degrees: float, norms: list[float] | None = None) -> torch.Tensor:
    """Token features [N, 2] pointing at the given angles (cosine = cos of the gap)."""
    norms = norms or [1.0] * len(degrees)
    pairs = zip(degrees, norms, strict=True)
    return torch.tensor([[r * math.cos(math.radians(d)), r * math.sin(math.radians(d))] for d, r in pairs])


def _inputs(
    keys: torch.Tensor,
    budget: int,
    normed: torch.Tensor | None = None,
    text_keys: torch.Tensor | None = None,
    text_normed: torch.Tensor | None = None,
) -> StageInputs:
    """One image whose visual tokens have ``keys`` [N, F] and final-normed states ``normed`` [N, D]
    (default: the keys), at prompt positions 0..N-1, followed by the text rows ``text_*`` (default: one
    padding row)."""
    n_visual = keys.shape[0]
    normed = keys if normed is None else normed
    after = torch.ones(1 if text_keys is None else text_keys.shape[0], dtype=torch.bool)
    if text_keys is None:
        text_keys, text_normed, after = keys[:1] * 0, normed[:1] * 0, ~after
    return StageInputs(
        budget=budget,
        hidden=normed[None],
        keys=keys[None],
        text_keys=text_keys[None],
        text_after=after[None],
        prompt_positions=torch.arange(n_visual)[None],
        text_prompt_positions=torch.arange(n_visual, n_visual + after.numel())[None],
        normed=normed[None],
        text_normed=text_normed[None],
    )


def _kept(selection: Selection) -> list[int]:
    return selection.indices[0].tolist()


@pytest.mark.parametrize("trial", range(200))
def test_set_order_is_pythons(trial: int) -> None:
    generator = random.Random(trial)
    values = generator.sample(range(generator.choice([20, 100, 700, 5000])), generator.randint(1, 12))
    order = set_order(torch.tensor(values)).tolist()
    assert [values[i] for i in order] == list(set(values))


def test_set_order_is_not_ascending_past_the_table() -> None:
    """Negative control: 35 and 3 share slot 3 of 32; 40 (slot 8) comes before 20 (slot 20)."""
    values = [40, 20, 35, 3, 1]
    assert [values[i] for i in set_order(torch.tensor(values)).tolist()] == list(set(values))
    assert list(set(values)) != sorted(values)


def test_the_pivot_and_the_tokens_least_similar_to_it() -> None:
    # token 0 has the largest L1 norm (pivot); cosines to it: 1 (token 1), 0 (2), -1 (3), 0.71 (4)
    keys = torch.tensor([[3.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 1.0]])
    assert _kept(dart(_inputs(keys, 3), image_pivots=1, text_pivots=0)) == [0, 2, 3]


def test_pivots_by_keys_similarity_by_normed_states() -> None:
    # keys make token 2 the pivot; on the normed states token 2 is opposite to token 0 (kept), while on
    # the keys token 3 would be the least similar to it
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 3.0], [0.0, -1.0]])
    normed = torch.tensor([[-1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.1]])
    assert _kept(dart(_inputs(keys, 2, normed), image_pivots=1, text_pivots=0)) == [0, 2]
    assert _kept(dart(_inputs(keys, 2), image_pivots=1, text_pivots=0)) == [2, 3]


def test_pivot_norm_is_l1_not_l2() -> None:
    # token 0: L1 3.0, L2 2.12; token 1: L1 2.9, L2 2.9. L1 makes token 0 the pivot, so token 3
    # (opposite to token 0) is kept; an L2 pivot (token 1) would keep token 2 (opposite to token 1).
    keys = torch.tensor([[1.5, 1.5], [0.0, 2.9], [0.0, -1.0], [-1.0, -1.0], [0.1, 0.9]])
    assert _kept(dart(_inputs(keys, 2), image_pivots=1, text_pivots=0)) == [0, 3]


def test_a_text_pivot_takes_the_tokens_least_similar_to_it() -> None:
    # image pivot: token 0 (east, position 0), visited first, takes token 2 (west); the text pivot
    # (west, position 5) then takes token 1 (10 deg). Without it the image pivot takes token 4 too.
    keys = _at_angles(0.0, 10.0, 180.0, 95.0, 250.0, norms=[5, 1, 1, 1, 1])
    text = _at_angles(180.0, norms=[9])
    with_text = dart(_inputs(keys, 3, text_keys=text, text_normed=text), image_pivots=1, text_pivots=1)
    assert _kept(with_text) == [0, 1, 2]
    assert _kept(dart(_inputs(keys, 3), image_pivots=1, text_pivots=0)) == [0, 2, 4]


def test_later_pivots_skip_tokens_already_taken() -> None:
    # both pivots point at 0 deg, so both want 180 deg then 170 deg: the second gets 135 and 90 deg
    keys = _at_angles(0.0, 0.0, 180.0, 170.0, 90.0, 135.0, 10.0, norms=[5, 4, 1, 1, 1, 1, 1])
    assert _kept(dart(_inputs(keys, 6), image_pivots=2, text_pivots=0)) == [0, 1, 2, 3, 4, 5]


def test_more_pivots_than_budget_keeps_the_largest_norms() -> None:
    keys = torch.tensor([[1.0, 0.0], [0.0, 4.0], [-2.0, 0.0], [0.0, -3.0], [0.5, 0.5]])
    assert _kept(dart(_inputs(keys, 2), image_pivots=4, text_pivots=0)) == [1, 3]


def test_missing_evidence_names_it() -> None:
    inputs = StageInputs(budget=2, hidden=torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match=r"dart needs .*keys.*needs=\('keys', 'final_norm'\)"):
        dart(inputs)


@pytest.mark.parametrize(("knob", "value"), [("image_pivots", 0), ("image_pivots", 1.5), ("text_pivots", -1)])
def test_bad_pivots_raise(knob: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"dart {knob} must be an int"):
        dart(_inputs(torch.randn(6, 3), 3), **{knob: value})
