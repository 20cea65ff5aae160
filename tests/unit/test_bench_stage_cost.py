"""``priortr bench``'s stage column brackets the stage's own work: a cost planted in a method's selector
shows up in it, in full, and a method without one shows only its real (small) work.

The planted cost is a sleep, so the lower bound is exact (a sleep never returns early); the upper bounds
are loose, about the planted cost again, so that a busy machine cannot fail them. On main before this
test the column's end mark fired before the engine's stage ran, and it showed ~0.06 ms for any method.
"""

from __future__ import annotations

import time

import pytest
import torch

import priortr
from priortr.methods.selection import Selection, StageInputs
from priortr.tools import bench
from tests.helpers.tiny import llava_batch, tiny_llava

PLANTED_S = 0.25
BUDGET = 4


def _keep_first(inputs: StageInputs) -> Selection:
    batch = inputs.hidden.shape[0]
    return Selection(indices=torch.arange(inputs.budget).expand(batch, inputs.budget))


@priortr.register_method(
    "test-slow-stage", where="layer", summary="test only: keeps the first K after a sleep", source="tests"
)
def _slow(inputs: StageInputs) -> Selection:
    time.sleep(PLANTED_S)
    return _keep_first(inputs)


@priortr.register_method(
    "test-plain-stage", where="layer", summary="test only: keeps the first K", source="tests"
)
def _plain(inputs: StageInputs) -> Selection:
    return _keep_first(inputs)


@pytest.fixture(scope="module")
def report():
    model = tiny_llava(dtype=torch.float32)
    return bench.run_bench(
        model,
        ["vanilla", "test-slow-stage", "test-plain-stage"],
        [BUDGET],
        [1],
        layer=1,
        text_tokens=6,
        new_tokens=1,
        warmup=1,
        repeats=3,
        decode_repeats=1,
    )


def test_a_cost_planted_in_the_selector_is_inside_the_stage_column(report):
    cases = {case.method: case for case in report.cases}
    slow = cases["test-slow-stage"].overhead_ms
    plain = cases["test-plain-stage"].overhead_ms
    planted_ms = PLANTED_S * 1e3
    assert slow.minimum >= planted_ms  # every run's stage held the whole sleep
    assert slow.median - plain.median == pytest.approx(planted_ms, abs=planted_ms)
    assert plain.median < planted_ms / 2  # a stage without the planted cost shows its own work only
    assert cases["vanilla"].overhead_ms is None  # no stage, no column


def test_the_stage_column_sits_inside_the_lm_prefill(report):
    for case in report.cases[1:]:
        assert case.overhead_ms.median < case.lm_prefill_ms.median


def test_the_table_says_what_each_column_brackets(report):
    table = bench.format_markdown(report)
    assert "| stage ms |" in table
    assert "stage ms = all of the pruning stages' own work" in table


def test_observe_stages_sees_each_stage_once_around_its_work():
    """The engine's observer calls: start then end, once per stage, with the stage's scored layer; the
    selector runs between them; nothing is called after the block."""
    model = tiny_llava(dtype=torch.float32)
    batch = llava_batch(model, 1)
    events: list[tuple[str, int]] = []

    def observer(event: str, layer: int) -> None:
        events.append((event, layer))

    with priortr.apply(model, method="pdrop", budget=4) as handle, torch.no_grad():
        with handle.observe_stages(observer):
            model(**batch.kwargs())
        stages = [stage.layer for stage in handle.last.stages]
        assert events == [(event, layer) for layer in stages for event in ("start", "end")]
        model(**batch.kwargs())
    assert len(events) == 2 * len(stages)
