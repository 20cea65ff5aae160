"""The plug-in's scheduler rules on stand-in requests, vLLM's own scheduling stubbed out: which
request is pruned, that a pruned request skips the prefix cache from its arrival, that a chunk ending
inside a pruned prompt is not scheduled, that a pruned answer ends before its positions leave the model's,
and the asynchronous variant. test_cache_and_chunks.py and test_request_limits.py run them in an
engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from priortr.integrations.vllm.processor import PROMPT_LENGTH_KEY, UNPRUNED_LENGTH_KEY, check_step_limit
from priortr.integrations.vllm.scheduler import PruningAsyncScheduler, PruningScheduler, pruned

PROMPT = 67
UNPRUNED_PROMPT = 91  # the prompt with every image whole
MAX_MODEL_LEN = 200
POSITIONS = 300  # max_position_embeddings, above max_model_len: the limit of a pruned request's positions


def feature(modality: str = "image", data: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(modality=modality, data=data)


def stand_in(*features: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(
        mm_features=list(features), num_prompt_tokens=PROMPT, skip_reading_prefix_cache=False, max_tokens=1
    )


def pruned_stand_in(unpruned: int = UNPRUNED_PROMPT) -> SimpleNamespace:
    """A pruned request as the processor sends it: its image carries both lengths (vLLM's field
    elements, read through ``.data``); the other image is unpruned."""
    lengths = {
        PROMPT_LENGTH_KEY: SimpleNamespace(data=PROMPT),
        UNPRUNED_LENGTH_KEY: SimpleNamespace(data=unpruned),
    }
    return stand_in(feature(data={"pixel_values": 0}), feature(data={"pixel_values": 0, **lengths}))


PRUNED = pruned_stand_in()
UNPRUNED = stand_in(feature(data={"pixel_values": 0}))


def test_a_pruned_request_is_one_whose_images_carry_the_prompt_length():
    assert pruned(PRUNED)
    assert not pruned(UNPRUNED)
    assert not pruned(stand_in())  # text only
    assert not pruned(stand_in(feature(data=None)))
    assert not pruned(stand_in(feature("video", {PROMPT_LENGTH_KEY: PROMPT})))


@pytest.fixture
def bare(monkeypatch) -> tuple[PruningScheduler, list, dict]:
    """A PruningScheduler without vLLM's state, whose base methods record their calls and choose the
    tokens of ``cut`` (vLLM's encoder budget cutting a chunk)."""
    calls: list = []
    cut: dict = {}

    def choose(self, request, computed, new, budget, shift=0):
        calls.append((computed, new))
        return [0], cut.get("tokens", new), budget - 1, [], []

    monkeypatch.setattr(Scheduler, "_try_schedule_encoder_inputs", choose)
    monkeypatch.setattr(Scheduler, "add_request", lambda self, request: calls.append(request))
    scheduler = object.__new__(PruningScheduler)
    text = SimpleNamespace(max_position_embeddings=POSITIONS)
    model = SimpleNamespace(max_model_len=MAX_MODEL_LEN, hf_text_config=text)
    scheduler.vllm_config = SimpleNamespace(model_config=model)
    return scheduler, calls, cut


def test_a_pruned_request_skips_the_prefix_cache_from_its_arrival(bare):
    scheduler, calls, _ = bare
    for request in (PRUNED, UNPRUNED):
        request.skip_reading_prefix_cache = False
        scheduler.add_request(request)
    assert calls == [PRUNED, UNPRUNED]
    assert PRUNED.skip_reading_prefix_cache and not UNPRUNED.skip_reading_prefix_cache


def test_a_pruned_answer_ends_before_its_positions_leave_the_model(bare):
    """A pruned request decodes at its original positions: its max_tokens is lowered to what its
    unpruned prompt leaves of the larger of max_model_len and max_position_embeddings (at least 1), a
    lower one kept, an unpruned request untouched; and max_model_len where it is the larger."""
    scheduler, _, _ = bare
    cases = [(pruned_stand_in(), 10**6, POSITIONS - UNPRUNED_PROMPT), (pruned_stand_in(), 5, 5)]
    cases += [
        (pruned_stand_in(POSITIONS), 10**6, 1),
        (stand_in(feature(data={"pixel_values": 0})), 10**6, 10**6),
    ]
    for request, asked, served in cases:
        request.max_tokens = asked
        scheduler.add_request(request)
        assert request.max_tokens == served
    scheduler.vllm_config.model_config.hf_text_config.max_position_embeddings = MAX_MODEL_LEN - 50
    request = pruned_stand_in()
    request.max_tokens = 10**6
    scheduler.add_request(request)
    assert request.max_tokens == MAX_MODEL_LEN - UNPRUNED_PROMPT


def test_a_chunk_ending_inside_a_pruned_prompt_is_not_scheduled(bare):
    scheduler, calls, cut = bare
    nothing = ([], 0, 100, [], [])
    assert scheduler._try_schedule_encoder_inputs(PRUNED, 0, 60, 100) == nothing
    assert calls == []  # decided before vLLM's choice, which may take encoder-cache references
    assert scheduler._try_schedule_encoder_inputs(PRUNED, 0, PROMPT, 100) == ([0], PROMPT, 99, [], [])
    assert scheduler._try_schedule_encoder_inputs(PRUNED, 0, 80, 100) == ([0], 80, 99, [], [])  # + outputs
    assert scheduler._try_schedule_encoder_inputs(PRUNED, PROMPT, 5, 100) == ([0], 5, 99, [], [])
    cut["tokens"] = 56  # vLLM stops before an image its budget cannot encode
    assert scheduler._try_schedule_encoder_inputs(PRUNED, 0, PROMPT, 100) == nothing
    assert scheduler._try_schedule_encoder_inputs(UNPRUNED, 0, PROMPT, 100) == ([0], 56, 99, [], [])
    cut.clear()
    assert scheduler._try_schedule_encoder_inputs(UNPRUNED, 0, 60, 100) == ([0], 60, 99, [], [])


def test_asynchronous_scheduling_gets_the_asynchronous_variant():
    """vLLM resolves asynchronous scheduling after the config hooks run, so the class is chosen when
    the engine builds it."""

    def built(asynchronous: bool) -> type:
        config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=asynchronous))
        return type(PruningScheduler.__new__(PruningScheduler, vllm_config=config))

    assert built(True) is PruningAsyncScheduler
    assert built(False) is PruningScheduler
    order = PruningAsyncScheduler.__mro__
    assert order.index(PruningScheduler) < order.index(AsyncScheduler) < order.index(Scheduler)
    assert PruningAsyncScheduler._update_after_schedule is AsyncScheduler._update_after_schedule


def test_a_pruned_prompt_longer_than_a_step_is_refused():
    check_step_limit(80, 80)
    check_step_limit(10_000, None)  # no config hook ran
    with pytest.raises(ValueError, match=r"87 tokens where a step holds 80 .* --max-num-batched-tokens"):
        check_step_limit(87, 80)
