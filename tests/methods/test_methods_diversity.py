"""Tests for the diversity methods of priortr.methods: DivPrune and VisPruner on hand-made tokens
(DART: tests/methods/test_methods_dart.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from priortr.methods.divprune import divprune
from priortr.methods.selection import Selection, StageInputs
from priortr.methods.vispruner import vispruner

SELECTORS: dict[str, Callable[[StageInputs], Selection]] = {
    "divprune": divprune,
    "vispruner": vispruner,
}


def _at_angles(*degrees: float, norms: list[float] | None = None) -> torch.Tensor:
    """One image of 2-D token features [1, N, 2] pointing at the given angles (cosine = cos of the gap)."""
    norms = norms or [1.0] * len(degrees)
    rows = [
        [r * math.cos(math.radians(d)), r * math.sin(math.radians(d))]
        for d, r in zip(degrees, norms, strict=True)
    ]
    return torch.tensor([rows])


def _inputs(hidden: torch.Tensor, budget: int, vision_cls: torch.Tensor | None = None) -> StageInputs:
    """Inputs whose features before the projector are ``hidden`` itself (VisPruner compares those)."""
    return StageInputs(budget=budget, hidden=hidden, vision_cls=vision_cls, vision_features=hidden)


def _kept(selection: Selection) -> list[list[int]]:
    return selection.indices.tolist()


def _random_inputs(budget: int, batch: int = 2, n_visual: int = 40, seed: int = 0) -> StageInputs:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, n_visual, 8, generator=generator)
    vision_cls = torch.softmax(torch.randn(batch, n_visual, generator=generator), dim=-1)
    return _inputs(hidden, budget, vision_cls)


# --- contract shared by the selectors ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SELECTORS))
@pytest.mark.parametrize("budget", [1, 3, 10, 39])
def test_keeps_exactly_k_ascending_int64(name: str, budget: int) -> None:
    selection = SELECTORS[name](_random_inputs(budget))
    assert selection.merge is None
    assert selection.indices.dtype == torch.int64
    assert tuple(selection.indices.shape) == (2, budget)
    assert bool((selection.indices[:, 1:] > selection.indices[:, :-1]).all())
    assert bool((selection.indices >= 0).all()) and bool((selection.indices < 40).all())


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_batch_equals_each_row_alone(name: str) -> None:
    batch = _random_inputs(12, batch=3, seed=1)
    together = SELECTORS[name](batch).indices
    for row in range(3):
        alone = _inputs(batch.hidden[row : row + 1], 12, batch.vision_cls[row : row + 1])
        assert torch.equal(SELECTORS[name](alone).indices[0], together[row])


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_rows_with_different_features_get_different_selections(name: str) -> None:
    kept = SELECTORS[name](_random_inputs(8, seed=2)).indices
    assert not torch.equal(kept[0], kept[1])


@pytest.mark.parametrize("name", sorted(SELECTORS))
@pytest.mark.parametrize("budget", [40, 41, 1000])
def test_budget_at_least_n_keeps_every_token(name: str, budget: int) -> None:
    selection = SELECTORS[name](_random_inputs(budget))
    assert torch.equal(selection.indices, torch.arange(40).expand(2, 40))
    assert selection.merge is None


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_half_precision_input_gives_the_float32_answer(name: str) -> None:
    inputs = _random_inputs(10, seed=3)
    half = _inputs(inputs.hidden.half(), 10, inputs.vision_cls.half())
    rounded = _inputs(half.hidden.float(), 10, half.vision_cls.float())
    assert torch.equal(SELECTORS[name](half).indices, SELECTORS[name](rounded).indices)


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_deterministic(name: str) -> None:
    inputs = _random_inputs(10, seed=4)
    assert torch.equal(SELECTORS[name](inputs).indices, SELECTORS[name](inputs).indices)


@pytest.mark.parametrize("name", sorted(SELECTORS))
@pytest.mark.parametrize("budget", [0, -1, 2.5, True])
def test_bad_budget_raises(name: str, budget: object) -> None:
    inputs = _random_inputs(1)
    with pytest.raises(ValueError, match="budget"):
        SELECTORS[name](_inputs(inputs.hidden, budget, inputs.vision_cls))


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_non_finite_hidden_raises(name: str) -> None:
    inputs = _random_inputs(5)
    hidden = inputs.hidden.clone()
    hidden[1, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        SELECTORS[name](_inputs(hidden, 5, inputs.vision_cls))


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_hidden_without_feature_axis_raises(name: str) -> None:
    with pytest.raises(ValueError, match=r"needs inputs.hidden.*\[B, N, D\]"):
        SELECTORS[name](StageInputs(budget=2, hidden=torch.ones(2, 5), vision_cls=torch.ones(2, 5)))


# --- DivPrune -------------------------------------------------------------------------------------


# Five tokens on the unit circle: 0 and 5 degrees are near-duplicates, 45 sits between 0 and 90,
# and 180 is the isolated far point (its nearest other token is 90 degrees away).
FAR_POINT = _at_angles(0.0, 5.0, 90.0, 45.0, 180.0)


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (1, [4]),  # first pick: the token whose nearest neighbour is farthest (180 deg, 90 deg away)
        (2, [0, 4]),  # farthest from 180 deg: 0 deg (180 apart) beats 5 deg (175 apart)
        (3, [0, 2, 4]),  # then 90 deg (90 from both) beats 45 deg (45) and the duplicate 5 deg (5)
        (4, [0, 2, 3, 4]),  # 45 deg (45 from its nearest) beats 5 deg (5): the duplicate goes last
    ],
)
def test_divprune_max_min_choices_by_hand(budget: int, expected: list[int]) -> None:
    assert _kept(divprune(_inputs(FAR_POINT, budget))) == [expected]


def test_divprune_drops_an_exact_duplicate() -> None:
    hidden = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]])
    assert _kept(divprune(_inputs(hidden, 3))) == [[0, 2, 3]]


@pytest.mark.parametrize(
    ("duplicate_of", "expected"),
    [
        # token 3 at -3 deg duplicates token 0 (0 deg): token 0 is the one dropped
        (-3.0, [1, 2, 3]),
        # token 3 at 123 deg duplicates token 2 (120 deg): now token 2 is dropped instead
        (123.0, [0, 1, 3]),
    ],
)
def test_divprune_drops_whichever_token_is_duplicated(duplicate_of: float, expected: list[int]) -> None:
    hidden = _at_angles(0.0, 50.0, 120.0, duplicate_of)
    assert _kept(divprune(_inputs(hidden, 3))) == [expected]


def test_divprune_ignores_feature_scale() -> None:
    scaled = FAR_POINT * torch.tensor([3.0, 0.5, 7.0, 1.0, 0.1]).view(1, 5, 1)
    assert _kept(divprune(_inputs(scaled, 3))) == [[0, 2, 4]]


def test_divprune_keeps_k_distinct_tokens_when_all_are_identical() -> None:
    hidden = torch.tensor([[[1.0, 0.0]] * 5])
    assert _kept(divprune(_inputs(hidden, 3))) == [[0, 1, 2]]


def _reference_divprune(features: list[list[float]], budget: int) -> list[int]:
    """Plain-Python greedy max-min selection in float64, written from the paper's definition."""

    def distance(i: int, j: int) -> float:
        dot = sum(a * b for a, b in zip(features[i], features[j], strict=True))
        norm_i = math.sqrt(sum(a * a for a in features[i]))
        norm_j = math.sqrt(sum(b * b for b in features[j]))
        return 1.0 - dot / (norm_i * norm_j)

    n = len(features)
    first = max(range(n), key=lambda j: min(distance(i, j) for i in range(n) if i != j))
    chosen = [first]
    while len(chosen) < budget:
        rest = [j for j in range(n) if j not in chosen]
        chosen.append(max(rest, key=lambda j: min(distance(i, j) for i in chosen)))
    return sorted(chosen)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_divprune_matches_a_plain_python_greedy(seed: int) -> None:
    inputs = _random_inputs(9, batch=2, n_visual=25, seed=seed)
    expected = [_reference_divprune(row.tolist(), 9) for row in inputs.hidden]
    assert _kept(divprune(inputs)) == expected


# --- VisPruner ------------------------------------------------------------------------------------

# [CLS] attention ranks tokens 0..7 in order: tokens 0-2 are important (K=6, ratio 0.5 -> 3); the
# residual [3, 4, 5, 6, 7] splits into side A = [3, 5, 7] and side B = [4, 6]; 2 A tokens must go.
CLS_ORDER = torch.tensor([[0.30, 0.20, 0.15, 0.12, 0.10, 0.06, 0.04, 0.03]])
EAST, NORTH, SOUTH_WEST = [1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]


def _vispruner_tokens(token_5: list[float], token_7: list[float]) -> torch.Tensor:
    """Tokens 0-3 point east (3 duplicates token 4), 4 east, 6 north; tokens 5 and 7 as given."""
    return torch.tensor([[EAST, EAST, EAST, EAST, EAST, token_5, NORTH, token_7]])


def test_vispruner_keeps_important_then_the_non_duplicated() -> None:
    # A scores: token 3 = 1 (duplicates 4), token 5 = 1 (duplicates 6), token 7 = -0.71: 3 and 5 go
    hidden = _vispruner_tokens(token_5=NORTH, token_7=SOUTH_WEST)
    assert _kept(vispruner(_inputs(hidden, 6, CLS_ORDER))) == [[0, 1, 2, 4, 6, 7]]


def test_vispruner_swapping_the_duplicate_changes_the_result() -> None:
    hidden = _vispruner_tokens(token_5=SOUTH_WEST, token_7=NORTH)
    assert _kept(vispruner(_inputs(hidden, 6, CLS_ORDER))) == [[0, 1, 2, 4, 5, 6]]


def test_vispruner_one_token_per_round_reaches_the_same_set_here() -> None:
    # step 1: round 1 drops 3 (first of the two scores of 1); round 2 on [5, 7, 4, 6] drops 5
    hidden = _vispruner_tokens(token_5=NORTH, token_7=SOUTH_WEST)
    assert _kept(vispruner(_inputs(hidden, 6, CLS_ORDER), step=1)) == [[0, 1, 2, 4, 6, 7]]


def test_vispruner_important_tokens_survive_even_when_duplicated() -> None:
    hidden = _vispruner_tokens(token_5=NORTH, token_7=SOUTH_WEST)
    kept = _kept(vispruner(_inputs(hidden, 6, CLS_ORDER)))[0]
    assert {0, 1, 2} <= set(kept)  # all three point east, like token 4


def test_vispruner_ratio_one_is_top_k_by_cls_attention() -> None:
    hidden = _vispruner_tokens(token_5=NORTH, token_7=SOUTH_WEST)
    assert _kept(vispruner(_inputs(hidden, 4, CLS_ORDER), important_ratio=1.0)) == [[0, 1, 2, 3]]


def test_vispruner_ratio_zero_ignores_cls_attention_for_selection() -> None:
    inputs = _random_inputs(10, seed=5)
    kept = vispruner(inputs, important_ratio=0.0).indices
    assert tuple(kept.shape) == (2, 10)
    assert not torch.equal(kept, vispruner(inputs, important_ratio=1.0).indices)


def test_vispruner_important_count_rounds_down() -> None:
    # K=7, ratio 0.5 -> int(3.5) = 3 important (0-2); of A = [3, 5, 7] one goes: token 3 (duplicates 4).
    # Rounding up to 4 important would keep token 3 and drop token 6 instead.
    hidden = _vispruner_tokens(token_5=NORTH, token_7=SOUTH_WEST)
    assert _kept(vispruner(_inputs(hidden, 7, CLS_ORDER))) == [[0, 1, 2, 4, 5, 6, 7]]


def _reference_vispruner(
    features: list[list[float]], cls_attention: list[float], budget: int, ratio: float, step: int
) -> list[int]:
    """Plain-Python VisPruner in float64, written from the authors' description of the procedure."""

    def cosine(i: int, j: int) -> float:
        dot = sum(a * b for a, b in zip(features[i], features[j], strict=True))
        return dot / math.sqrt(sum(a * a for a in features[i]) * sum(b * b for b in features[j]))

    order = sorted(range(len(features)), key=lambda i: -cls_attention[i])
    n_important = int(budget * ratio)
    important, residual = order[:n_important], order[n_important:]
    n_diverse = budget - n_important
    while n_diverse > 0 and len(residual) > n_diverse:
        drop = min(step, len(residual) - n_diverse)
        side_a, side_b = residual[0::2], residual[1::2]
        duplication = {i: max(cosine(i, j) for j in side_b) for i in side_a}
        residual = sorted(side_a, key=lambda i: -duplication[i])[drop:] + side_b
    return sorted(important + (residual if n_diverse > 0 else []))


@pytest.mark.parametrize(("ratio", "step"), [(0.5, 8), (0.5, 1), (0.25, 3), (0.0, 2), (1.0, 8)])
def test_vispruner_matches_a_plain_python_reference(ratio: float, step: int) -> None:
    inputs = _random_inputs(10, batch=2, n_visual=30, seed=6)
    expected = [
        _reference_vispruner(row.tolist(), cls.tolist(), 10, ratio, step)
        for row, cls in zip(inputs.hidden, inputs.vision_cls, strict=True)
    ]
    assert _kept(vispruner(inputs, important_ratio=ratio, step=step)) == expected


def test_vispruner_without_cls_attention_raises_and_names_alternatives() -> None:
    hidden = _vispruner_tokens(token_5=NORTH, token_7=SOUTH_WEST)
    with pytest.raises(ValueError, match=r"inputs\.vision_cls.*use divprune, dart"):
        vispruner(_inputs(hidden, 4))


def test_vispruner_without_features_before_the_projector_raises() -> None:
    hidden = _vispruner_tokens(token_5=NORTH, token_7=SOUTH_WEST)
    inputs = StageInputs(budget=6, hidden=hidden, vision_cls=CLS_ORDER)
    with pytest.raises(ValueError, match=r"inputs\.vision_features"):
        vispruner(inputs)


def test_vispruner_compares_the_features_before_the_projector_not_hidden() -> None:
    """The authors de-duplicate the tower's features; the projector's outputs (hidden) are not read."""
    features = _vispruner_tokens(token_5=NORTH, token_7=SOUTH_WEST)
    swapped = _vispruner_tokens(token_5=SOUTH_WEST, token_7=NORTH)
    inputs = StageInputs(budget=6, hidden=swapped, vision_cls=CLS_ORDER, vision_features=features)
    assert _kept(vispruner(inputs)) == [[0, 1, 2, 4, 6, 7]]  # as for features alone, not for swapped


def test_vispruner_cls_attention_of_the_wrong_shape_raises() -> None:
    hidden = _vispruner_tokens(token_5=NORTH, token_7=SOUTH_WEST)
    with pytest.raises(ValueError, match=r"vision_cls must be \[B, N\]"):
        vispruner(_inputs(hidden, 4, CLS_ORDER[:, :7]))


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"important_ratio": 1.5}, "important_ratio must be in"),
        ({"important_ratio": -0.1}, "important_ratio must be in"),
        ({"important_ratio": "half"}, "important_ratio must be a number"),
        ({"step": 0}, "step must be an int >= 1"),
        ({"step": 2.0}, "step must be an int >= 1"),
    ],
)
def test_vispruner_bad_knobs_raise(knobs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        vispruner(_random_inputs(5), **knobs)
