"""The plug-in's scheduler rules on stand-in requests, vLLM's own scheduling stubbed out: which
request is pruned, that a pruned request skips the prefix cache from its arrival, that a chunk ending
inside a pruned prompt is not scheduled, that a pruned answer ends before its positions leave the model's,
and the asynchronous variant. test_cache_and_chunks.py and test_request_limits.py run them in an
engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from priortr.integrations.vllm.encoder_cache import PrunedEncoderCache
from priortr.integrations.vllm.processor import check_step_limit
from priortr.integrations.vllm.request_records import ImageRecord
from priortr.integrations.vllm.scheduler import PruningAsyncScheduler, PruningScheduler, pruned

PROMPT = 67
UNPRUNED_PROMPT = 91  # the prompt with every image whole
MAX_MODEL_LEN = 200
POSITIONS = 300  # max_position_embeddings, above max_model_len: the limit of a pruned request's positions


def feature(modality: str = "image", data: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(modality=modality, data=data)


def stand_in(*features: SimpleNamespace) -> SimpleNamespace:
    """A request as vLLM 0.32/0.33 builds it (0.34's prefix-cache field: ``test_release_0_34.py``)."""
    return SimpleNamespace(
        request_id="r",
        mm_features=list(features),
        num_prompt_tokens=PROMPT,
        skip_reading_prefix_cache=False,
        max_tokens=1,
        resumable=False,
    )


def pruned_stand_in(unpruned: int = UNPRUNED_PROMPT) -> SimpleNamespace:
    """A pruned request as the processor sends it: its image carries the record (vLLM's field
    elements, read through ``.data``; this image keeps its 4 tokens, so the encoder charges are
    vLLM's own); the other item carries none."""
    record = ImageRecord(prompt_length=PROMPT, kept_count=4, encoded=4, unpruned_length=unpruned).fields()
    image = feature(data={"pixel_values": 0, **record})
    image.mm_position = SimpleNamespace(get_num_embeds=lambda: 4)
    return stand_in(feature(data={"pixel_values": 0}), image)


PRUNED = pruned_stand_in()
UNPRUNED = stand_in(feature(data={"pixel_values": 0}))


def test_a_pruned_request_is_one_whose_images_carry_the_prompt_length():
    assert pruned(PRUNED)
    assert not pruned(UNPRUNED)
    assert not pruned(stand_in())  # text only
    assert not pruned(stand_in(feature(data=None)))
    assert not pruned(stand_in(feature("video", ImageRecord(PROMPT, 4, 16, UNPRUNED_PROMPT).fields())))


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
    scheduler.max_num_scheduled_tokens, scheduler.max_num_encoder_input_tokens = 1000, 100
    scheduler.refused_sessions, scheduler.encoder_cache_mismatch_reqs = set(), set()
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


def test_the_prefix_cache_switch_is_the_release_s_own(bare):
    """vLLM 0.34's request carries the hit bound (None: unbounded), which the scheduler sets to 0 and
    leaves any old attribute alone; a request with neither switch is refused (it would read the cache)."""
    scheduler, calls, _ = bare
    bounded = pruned_stand_in()
    del bounded.skip_reading_prefix_cache
    bounded.prefix_cache_hit_limit = None
    scheduler.add_request(bounded)
    assert bounded.prefix_cache_hit_limit == 0 and not hasattr(bounded, "skip_reading_prefix_cache")
    neither = pruned_stand_in()
    del neither.skip_reading_prefix_cache
    with pytest.raises(RuntimeError, match="prefix_cache_hit_limit"):
        scheduler.add_request(neither)
    assert calls == [bounded]


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


N, K = 16, 4  # an image's embeddings and its kept placeholders


def image_of(encoded: int = N, kept: int = K, prompt: int = PROMPT) -> SimpleNamespace:
    """A pruned image: its record as the processor writes it, K placeholders (the unpruned length,
    which these charges do not read, is one that every request below fits)."""
    data = ImageRecord(prompt, kept, encoded, unpruned_length=1_000).fields()
    return SimpleNamespace(
        modality="image", data=data, mm_position=SimpleNamespace(get_num_embeds=lambda: kept)
    )


UNPRUNED_IMAGE = stand_in(
    SimpleNamespace(modality="image", data={}, mm_position=SimpleNamespace(get_num_embeds=lambda: N))
)


@pytest.fixture
def charging(monkeypatch) -> PruningScheduler:
    """A PruningScheduler over a stand-in of vLLM's choice: every image of the request scheduled whole,
    the encoder budget charged the placeholders' embeddings (K), as vLLM 0.33 charges
    (``vllm/v1/core/sched/scheduler.py:2076,2198-2199``)."""

    def choose(self, request, computed, new, budget, shift=0):
        features = request.mm_features
        return (
            list(range(len(features))),
            new,
            budget - sum(f.mm_position.get_num_embeds() for f in features),
            [],
            [],
        )

    monkeypatch.setattr(Scheduler, "_try_schedule_encoder_inputs", choose)
    monkeypatch.setattr(Scheduler, "schedule", lambda self: "scheduled")
    scheduler = object.__new__(PruningScheduler)
    scheduler.max_num_scheduled_tokens, scheduler.max_num_encoder_input_tokens = 200, 100
    scheduler.encoder_cache_mismatch_reqs = set()
    return scheduler


def test_the_encoder_budget_is_charged_n_per_pruned_image(charging):
    """Each call is the first pruned prompt of its step (``schedule`` runs before it), so only the
    encoder budget decides."""

    def left(request, budget):
        charging.schedule()
        return charging._try_schedule_encoder_inputs(request, 0, PROMPT, budget)

    assert left(stand_in(image_of(), image_of(24, 6)), 100)[2] == 100 - 16 - 24
    one = stand_in(image_of())
    assert left(one, 50)[2] == 50 - 16
    assert left(one, 16)[2] == 0
    assert left(one, 15) == ([], 0, 15, [], [])  # waits for a step with room for N
    assert left(UNPRUNED_IMAGE, 50)[2] == 50 - 16  # vLLM's own charge
    # A prompt whose images exceed the whole budget runs alone, as the step's first encoder work (its
    # S = 213 within the step here: the processor refuses a longer one, test_request_limits.py).
    charging.max_num_scheduled_tokens = 300
    big = stand_in(image_of(150))
    assert left(big, 100)[:3] == ([0], PROMPT, 0)
    assert left(big, 99) == ([], 0, 99, [], [])


def test_the_pruned_prompts_of_a_step_hold_at_most_a_step_of_whole_prompts(charging):
    """S = P + N - K = 67 + 12 = 79 per prompt against a step of 200: two start, the third waits for
    the next step (a prompt whose S alone is more than a step is refused by the processor:
    ``test_request_limits.py``)."""
    prompts = [stand_in(image_of()) for _ in range(3)]
    assert charging.schedule() == "scheduled"
    chosen = [charging._try_schedule_encoder_inputs(p, 0, PROMPT, 100)[1] for p in prompts]
    assert chosen == [PROMPT, PROMPT, 0] and charging.pruned_tokens == 2 * 79
    assert charging._try_schedule_encoder_inputs(UNPRUNED_IMAGE, 0, PROMPT, 100)[1] == PROMPT  # not counted
    assert charging._try_schedule_encoder_inputs(prompts[2], PROMPT, 3, 100)[1] == 3  # after its prompt
    charging.schedule()
    assert charging.pruned_tokens == 0
    assert charging._try_schedule_encoder_inputs(prompts[2], 0, PROMPT, 100)[1] == PROMPT
    assert charging.pruned_tokens == 79


def cache_request(name: str, *images: tuple[int, int]) -> SimpleNamespace:
    """A request whose pruned images are (N, K) each, identified ``{name}{index}``."""
    features = [image_of(n, k) for n, k in images]
    for index, each in enumerate(features):
        each.identifier = f"{name}{index}"
    return SimpleNamespace(
        request_id=name,
        mm_features=features,
        get_num_encoder_embeds=lambda i: features[i].mm_position.get_num_embeds(),
    )


def test_the_encoder_cache_counts_n_per_pruned_image():
    """A cache of 40 embeddings: a pruned image of N = 16 (K = 4) takes 16 slots, so one of N = 30
    finds no room until the first is freed and evicted; vLLM's own count (K) would admit it at once.
    The scheduler's reuse check still reads the placeholders' count (K)."""
    first, second = cache_request("a", (16, 4)), cache_request("b", (30, 4))
    stock = EncoderCacheManager(40)
    assert stock.can_allocate(first, 0, 100, 0)
    stock.allocate(first, 0)
    assert stock.can_allocate(second, 0, 100, 0)  # counted at K: 4 + 4 of 40
    cache = PrunedEncoderCache(40)
    assert cache.can_allocate(first, 0, 100, 0)
    cache.allocate(first, 0)
    assert (cache.num_free_slots, cache.num_embeds_by_hash["a0"]) == (24, 16)
    assert cache.get_cached_num_encoder_embeds(first, 0) == 4
    assert not cache.can_allocate(second, 0, 100, 0)
    cache.free(first)  # no request holds it: freeable, evicted when room is needed
    assert cache.can_allocate(second, 0, 100, 0)
    assert cache.freed == ["a0"] and cache.get_cached_num_encoder_embeds(first, 0) is None
    cache.allocate(second, 0)
    assert cache.num_free_slots == 40 - 30


@pytest.mark.parametrize(("taken", "room"), [(0, True), (5, False)])
def test_the_encoder_cache_counts_a_requests_earlier_images(taken, room):
    """Two pruned images of N = 8 (K = 2) in one call, in a cache of 20 where another request holds
    ``taken``: vLLM passes the first's K (2) as already scheduled; the second needs
    2 + 2 + (8 - 2) * 2 = 16 slots."""
    cache = PrunedEncoderCache(20)
    if taken:
        other = cache_request("held", (taken, taken))
        assert cache.can_allocate(other, 0, 100, 0)
        cache.allocate(other, 0)
    request = cache_request("c", (8, 2), (8, 2))
    assert cache.can_allocate(request, 0, 100, 0)
    assert cache.can_allocate(request, 1, 100, 2) is room


def test_images_the_whole_cache_could_not_hold_at_n_are_counted_at_k():
    """A cache of 20 and an image of N = 30: counted at K = 4, as vLLM counts it, so that its request is
    served rather than waiting for room that never comes."""
    request = cache_request("d", (30, 4))
    cache = PrunedEncoderCache(20)
    assert cache.can_allocate(request, 0, 100, 0)
    cache.allocate(request, 0)
    assert cache.num_free_slots == 16
    assert cache.get_freed_mm_hashes() == [] and cache.checked == {}
