"""What the plug-in refuses, and that it refuses it before serving, with the setting to change."""

from __future__ import annotations

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins

from priortr.integrations.vllm.config_hooks import PruningConfigHook, refusals
from priortr.integrations.vllm.decoder import check_backend
from priortr.integrations.vllm.processor import STEP_LIMIT_KEY
from priortr.integrations.vllm.scheduler import PruningScheduler
from priortr.integrations.vllm.settings import (
    RequestPolicy,
    check_request_kwargs,
    engine_config,
    request_config,
    request_policy,
)

N_LAYERS = 4


def config_of(model_dir, **overrides):
    load_general_plugins()
    args = {
        "model": str(model_dir),
        "max_model_len": 256,
        "max_num_batched_tokens": 256,
        "enforce_eager": True,
        "hf_overrides": {"priortr": {"method": "fastv", "budget": 4}},
        **overrides,
    }
    return EngineArgs(**args).create_engine_config()


def test_exact_settings_start(llava_dir):
    config = config_of(llava_dir)
    assert config.model_config.uses_mrope  # LLaVA gets vLLM's per-request positions


@pytest.mark.parametrize(
    ("setting", "flag"),
    [
        ({"enforce_eager": False}, "--enforce-eager"),
    ],
)
def test_conflicting_engine_settings_are_refused(llava_dir, setting, flag):
    with pytest.raises(ValueError, match=flag):
        config_of(llava_dir, **setting)


def test_prefix_caching_and_chunked_prefill_start_with_the_plug_ins_scheduler(llava_dir):
    """vLLM's defaults (both on) start, scheduled by PruningScheduler, and the processor learns the
    longest prompt a step holds; a stock model keeps vLLM's scheduler."""
    config = config_of(llava_dir)
    assert config.cache_config.enable_prefix_caching and config.scheduler_config.enable_chunked_prefill
    assert config.scheduler_config.get_scheduler_cls() is PruningScheduler
    assert getattr(config.model_config.hf_config, STEP_LIMIT_KEY) == 256
    limited = config_of(llava_dir, long_prefill_token_threshold=100)
    assert getattr(limited.model_config.hf_config, STEP_LIMIT_KEY) == 100
    assert config_of(llava_dir, hf_overrides={}).scheduler_config.scheduler_cls is None


def test_another_scheduler_is_refused_while_it_could_split_a_pruned_prompt(llava_dir):
    """A scheduler of the user's own would not keep a pruned prompt whole and off the prefix cache;
    with both features off it is the user's choice (and the negative control of the refusal)."""
    ours = "vllm.v1.core.sched.scheduler.Scheduler"
    for features in [{}, {"enable_prefix_caching": False}, {"enable_chunked_prefill": False}]:
        with pytest.raises(ValueError, match=r"scheduler class .* drop --scheduler-cls"):
            config_of(llava_dir, scheduler_cls=ours, **features)
    off = {"enable_prefix_caching": False, "enable_chunked_prefill": False}
    assert config_of(llava_dir, scheduler_cls=ours, **off).scheduler_config.scheduler_cls == ours


@pytest.mark.parametrize(
    ("setting", "flag"),
    [
        ({"video_pruning_rate": 0.5}, "--video-pruning-rate"),
        ({"kv_offloading_size": 1.0}, "--kv-offloading-size"),
        (
            {"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}},
            "--kv-transfer-config",
        ),
        (
            {"ec_transfer_config": {"ec_connector": "ECExampleConnector", "ec_role": "ec_both"}},
            "--ec-transfer-config",
        ),
        ({"enable_lora": True}, "--enable-lora"),
        ({"compilation_config": {"cudagraph_mm_encoder": True}}, "cudagraph_mm_encoder"),
        ({"data_parallel_size": 2}, "--data-parallel-size 1"),
        ({"mm_processor_cache_type": "shm"}, "--mm-processor-cache-type lru"),
    ],
    ids=[
        "video-pruning",
        "kv-offloading",
        "kv-connector",
        "ec-connector",
        "lora",
        "encoder-graphs",
        "dp",
        "shm-cache",
    ],
)
def test_settings_that_break_pruning_are_refused(qwen2_5_dir, setting, flag):
    """Each setting alone, on Qwen2.5-VL (the family with video pruning); the same settings without
    priortr start (a negative control of the refusal, not of the setting)."""
    with pytest.raises(ValueError, match=flag):
        config_of(qwen2_5_dir, **setting)
    config_of(qwen2_5_dir, **setting, hf_overrides={})


def test_model_runner_v2_starts(llava_dir, monkeypatch):
    """vLLM's CPU build cannot configure Model Runner V2 (it needs a Triton with a CPU backend), so V2
    is stood in by the config's own flag: an engine that would run it is accepted
    (test_model_runner_v2.py drives V2's input preparation after a preemption)."""
    config = config_of(llava_dir)
    monkeypatch.setattr(type(config), "use_v2_model_runner", property(lambda self: True))
    assert config.use_v2_model_runner
    assert refusals(config) == []
    PruningConfigHook.verify_and_update_config(config)


def test_unreadable_attention_backend_is_refused():
    class Backend:
        @staticmethod
        def get_name() -> str:
            return "FLASHINFER"

    class Attention(torch.nn.Module):
        def get_attn_backend(self) -> type:
            return Backend

    with pytest.raises(ValueError, match=r"FLASHINFER backend .* --attention-backend"):
        check_backend(Attention())
    Backend.get_name = staticmethod(lambda: "CPU_ATTN")
    check_backend(Attention())  # negative control: the CPU build's backend is read


def test_stock_model_is_untouched(llava_dir):
    """Without priortr settings the plug-in's classes leave vLLM's defaults and positions alone."""
    config = config_of(llava_dir, hf_overrides={}, enable_chunked_prefill=True)
    assert not config.model_config.uses_mrope


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"method": "visionzip"}, "before the language model"),
        ({"method": "pdrop"}, "several decoder layers"),
        ({"method": "dart"}, "final_norm, keys evidence"),
        ({"method": "priortr+merge"}, "merge tokens"),
        ({"method": "priortr", "layer": 3}, r"layer must be an int in \[0, 2\]"),
        ({"method": "priortr", "budget": 0}, "positive token count"),
        ({"method": "priortr", "multi_image": "global"}, "unknown priortr setting"),
        ("priortr", "must be a dict"),
    ],
)
def test_unservable_methods_and_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        engine_config(settings, N_LAYERS)


def test_request_settings():
    config = engine_config({"method": "priortr", "budget": 64}, N_LAYERS)
    assert request_config(config, None) is config
    assert request_config(config, {"budget": 0.25}).budget == 0.25
    assert request_config(config, {"enabled": False}) is None
    for bad, message in [({"layer": 1}, "only budget, enabled"), ({"budget": -1}, "positive"), (3, "a dict")]:
        with pytest.raises(ValueError, match=message):
            request_config(config, bad)


def test_request_policy():
    """The operator's allow-lists: budgets a request may ask for, processor keywords beside priortr."""
    settings = {"method": "priortr", "budget": 64, "request_budgets": [32, 0.25]}
    config = engine_config(settings, N_LAYERS)
    policy = request_policy(settings)
    assert request_config(config, {"budget": 32}, policy).budget == 32
    assert request_config(config, {"budget": 0.25}, policy).budget == 0.25
    assert request_config(config, {"enabled": False}, policy) is None
    with pytest.raises(ValueError, match=r"request budgets 32, 0\.25; got 16"):
        request_config(config, {"budget": 16}, policy)
    assert request_config(config, {"budget": 16}).budget == 16  # no list: any valid budget
    for bad in [
        {"request_budgets": []},
        {"request_budgets": [0]},
        {"request_processor_kwargs": "max_pixels"},
    ]:
        with pytest.raises(ValueError, match=r"request_|positive"):
            engine_config({"method": "priortr", **bad}, N_LAYERS)


def test_request_processor_kwargs_beside_priortr_are_refused():
    request = {"priortr": {"budget": 8}, "max_pixels": 4096}
    with pytest.raises(ValueError, match=r"only .priortr. .* got max_pixels"):
        check_request_kwargs(request, {}, RequestPolicy())
    check_request_kwargs(request, {"max_pixels": 4096}, RequestPolicy())  # the operator's own value
    check_request_kwargs(request, {}, RequestPolicy(processor_kwargs=frozenset({"max_pixels"})))
    check_request_kwargs({"priortr": {"budget": 8}}, {}, RequestPolicy())
