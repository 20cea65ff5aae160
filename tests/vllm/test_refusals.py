"""What the plug-in refuses, and that it refuses it before serving, with the setting to change."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig
from vllm.plugins import load_general_plugins

from priortr.integrations.vllm.architectures import UNSERVED
from priortr.integrations.vllm.config_hooks import (
    BREAKABLE_GRAPHS,
    PruningConfigHook,
    UnservedFamilyHook,
    refusals,
    unserved_hook,
)
from priortr.integrations.vllm.decoder import check_backend
from priortr.integrations.vllm.scheduler import PruningScheduler
from priortr.integrations.vllm.served_families import FAMILIES
from priortr.integrations.vllm.settings import (
    STEP_LIMIT_KEY,
    RequestPolicy,
    check_request_kwargs,
    check_request_media,
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
    "setting",
    [
        {"enforce_eager": False},
        {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}},
        {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}},
        {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "PIECEWISE"}},
        {"compilation_config": {"cudagraph_mode": "FULL"}},  # enforce_eager: no graph is captured
        {"tensor_parallel_size": 2},
        {"data_parallel_size": 2},
    ],
    ids=["compiled", "full-and-piecewise", "full-decode-only", "piecewise", "eager-full", "tp", "dp"],
)
def test_compiled_and_parallel_settings_start(llava_dir, setting):
    """vLLM's compiled model with the CUDA-graph modes that leave a pruned step to the model's Python
    forward, tensor and data parallelism: served (test_compiled.py and test_parallel.py run them)."""
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
        ({"enforce_eager": False, "compilation_config": {"mode": 1}}, "compilation mode at vLLM's default"),
        (
            {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL"}},
            "FULL_AND_PIECEWISE .vLLM's default., FULL_DECODE_ONLY, PIECEWISE or NONE",
        ),
    ],
    ids=["stock-compile", "full-graphs"],
)
def test_graphs_that_skip_the_pruned_step_are_refused(llava_dir, setting, flag):
    """Stock torch.compile of the whole model and FULL graphs for batches with prefills would run a
    pruned step without the plug-in's forward. The same settings without priortr start (a control of
    the refusal)."""
    with pytest.raises(ValueError, match=flag):
        config_of(llava_dir, **setting)
    config_of(llava_dir, **{**setting, "hf_overrides": {}})


def test_breakable_cuda_graphs_are_refused(llava_dir, monkeypatch):
    """vLLM's breakable CUDA graphs wrap the whole model, the plug-in's forward included; refused
    unless no piecewise graph is captured."""
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    with pytest.raises(ValueError, match="unset VLLM_USE_BREAKABLE_CUDAGRAPH"):
        config_of(llava_dir, enforce_eager=False)
    config_of(llava_dir, enforce_eager=False, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})
    config_of(llava_dir)  # enforce_eager


def test_breakable_cuda_graphs_stay_off_where_vllm_would_turn_them_on(llava_dir, monkeypatch):
    """vLLM turns breakable CUDA graphs on by itself after the config hooks have run, for the
    architectures it lists or under batch-invariant mode, unless VLLM_USE_BREAKABLE_CUDAGRAPH is set
    (vLLM 0.33: vllm/config/vllm.py:842-862, run at :1793 after the hooks at :1539; 0.32 alike).
    Emulated by reporting LLaVA as a listed architecture: a stock LLaVA then gets them (the emulation
    works), a pruning one keeps them off (its hook sets vLLM's opt-out, 0)."""
    monkeypatch.setattr(VllmConfig, "_uses_breakable_cudagraph_by_default", lambda self: True)
    monkeypatch.setenv(BREAKABLE_GRAPHS, "restored after the test")
    monkeypatch.delenv(BREAKABLE_GRAPHS)
    config_of(llava_dir, enforce_eager=False, hf_overrides={})
    assert os.environ.get(BREAKABLE_GRAPHS) == "1"
    monkeypatch.delenv(BREAKABLE_GRAPHS)
    config_of(llava_dir, enforce_eager=False)
    assert os.environ.get(BREAKABLE_GRAPHS) == "0"


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("prefill_context_parallel_size", 2, "--prefill-context-parallel-size 1"),
        ("decode_context_parallel_size", 2, "--decode-context-parallel-size 1"),
        ("ubatch_size", 2, "--ubatch-size"),
        ("enable_dbo", True, "--enable-dbo"),
    ],
    ids=["pcp", "dcp", "ubatch", "dbo"],
)
def test_context_parallelism_and_micro_batching_are_refused(llava_dir, field, value, flag):
    """Settings that split a prompt across ranks (PCP: its rows; DCP: its KV cache) or a step into
    micro-batches (vLLM 0.33: vllm/config/parallel.py:144, :389, :645-646; the V1 runner's
    UBatchWrapper, vllm/v1/worker/gpu_model_runner.py:5159), set on a built config: vLLM's CPU build
    refuses PCP (V1 runner), DCP on this checkpoint (it needs more ranks than KV heads) and
    --ubatch-size (its all-to-all backends) itself. The same config without the setting has no
    refusal (the negative control)."""
    config = config_of(llava_dir)
    assert refusals(config) == []
    setattr(config.parallel_config, field, value)
    assert [line for line in refusals(config) if flag in line]
    with pytest.raises(ValueError, match=flag):
        PruningConfigHook.verify_and_update_config(config)


@pytest.mark.parametrize(
    ("setting", "env", "flag"),
    [
        ({"enable_dbo": True}, {}, "--enable-dbo"),
        ({"enforce_eager": False}, {"VLLM_BATCH_INVARIANT": "1"}, "unset VLLM_BATCH_INVARIANT"),
    ],
    ids=["dbo", "batch-invariant"],
)
def test_dual_batch_overlap_and_batch_invariance_are_refused_where_stock_starts(
    llava_dir, monkeypatch, setting, env, flag
):
    """Dual-batch overlap and batch-invariant mode, which vLLM's CPU build accepts: refused with
    priortr settings when the engine starts, the same settings without them start."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=flag):
        config_of(llava_dir, **setting)
    config_of(llava_dir, **setting, hf_overrides={})


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
        ({"mm_processor_cache_type": "shm"}, "--mm-processor-cache-type lru"),
    ],
    ids=[
        "video-pruning",
        "kv-offloading",
        "kv-connector",
        "ec-connector",
        "lora",
        "encoder-graphs",
        "shm-cache",
    ],
)
def test_settings_that_break_pruning_are_refused(qwen2_5_dir, setting, flag):
    """Each setting alone, on Qwen2.5-VL (the family with video pruning); the same settings without
    priortr start (a negative control of the refusal, not of the setting)."""
    with pytest.raises(ValueError, match=flag):
        config_of(qwen2_5_dir, **setting)
    config_of(qwen2_5_dir, **setting, hf_overrides={})


def test_scoring_before_the_last_deepstack_layer_is_refused(qwen3_vl_dir):
    """Qwen3-VL adds DeepStack features to the outputs of decoder layers 0 and 1: scoring layer 0 would
    cut before the last injection, refused when the engine starts as priortr.apply refuses it; layer 1
    (the last injected layer) starts."""
    with pytest.raises(
        ValueError, match=r"0\.\.1 \(DeepStack\), so fastv cannot prune after layer 0; score layer 1"
    ):
        config_of(qwen3_vl_dir, hf_overrides={"priortr": {"method": "fastv", "budget": 4, "layer": 0}})
    config_of(qwen3_vl_dir, hf_overrides={"priortr": {"method": "fastv", "budget": 4, "layer": 1}})


def test_pruning_before_the_language_model_is_refused_with_deepstack(qwen3_vl_dir):
    """A method pruning before the language model would cut before Qwen3-VL's DeepStack injections:
    refused when the engine starts, as priortr.apply refuses it (issue 57)."""
    with pytest.raises(
        ValueError, match=r"0\.\.1 \(DeepStack\), so divprune cannot prune before the language model"
    ):
        config_of(qwen3_vl_dir, hf_overrides={"priortr": {"method": "divprune", "budget": 4}})


def test_unserved_family_with_priortr_settings_is_refused(tmp_path):
    """Idefics3 is pruned by priortr.apply, not by the plug-in: with priortr settings the engine refuses
    to start (vLLM would serve it unpruned); without them it starts as vLLM's own model."""
    from tests.vllm import checkpoints

    path = checkpoints.idefics3(tmp_path / "idefics3")
    with pytest.raises(
        ValueError, match=r"does not serve Idefics3ForConditionalGeneration .* served unpruned"
    ):
        config_of(path)
    config_of(path, hf_overrides={})


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"enable_expert_parallel": True}, r"data or expert parallelism of a mixture-of-experts"),
        ({"enable_return_routed_experts": True}, r"returning routed experts"),
    ],
)
def test_moe_settings_the_plugin_has_not_run_are_refused(qwen3_vl_moe_dir, setting, message):
    """Qwen3-VL MoE is served without expert (or data) parallelism and without returned routing: each
    is refused at engine start with the setting to change (tensor parallelism is served:
    ``test_parallel.py``)."""
    with pytest.raises(ValueError, match=message):
        config_of(qwen3_vl_moe_dir, **setting)


def test_moe_hook_refuses_load_balancing_and_finds_moe_layers_by_name(qwen3_vl_moe_dir):
    """Expert load balancing (which vLLM's CPU build refuses itself, so set on a built config) is
    refused; a pruned step calls MoE blocks outside vLLM's layer order, so the hook turns
    fast_moe_cold_start off (layers found by name, not call order; vLLM on torch >= 2.11 turns it off
    too), and leaves it on for a config without priortr settings."""
    hook = MODELS_CONFIG_MAP["Qwen3VLMoeForConditionalGeneration"]
    config = config_of(qwen3_vl_moe_dir)
    config.parallel_config.enable_eplb = True
    with pytest.raises(ValueError, match=r"expert load balancing: .*--enable-eplb"):
        hook.verify_and_update_config(config)
    config.parallel_config.enable_eplb = False
    config.compilation_config.fast_moe_cold_start = True
    hook.verify_and_update_config(config)
    assert config.compilation_config.fast_moe_cold_start is False
    stock = config_of(qwen3_vl_moe_dir, hf_overrides={})
    stock.compilation_config.fast_moe_cold_start = True
    hook.verify_and_update_config(stock)
    assert stock.compilation_config.fast_moe_cold_start is True


def test_scored_layer_past_the_first_pipeline_stage_is_refused(qwen3_vl_moe_dir):
    """At pipeline parallelism 2 the first stage holds decoder layers 0-1 of 4: scoring layer 2 is
    refused at engine start (the first stage plans and cuts a pruned step); layer 1 starts."""
    settings = {"method": "fastv", "budget": 4}
    with pytest.raises(ValueError, match=r"scored layer 2 past the first stage \(layers 0\.\.1\)"):
        config_of(
            qwen3_vl_moe_dir, pipeline_parallel_size=2, hf_overrides={"priortr": {**settings, "layer": 2}}
        )
    config_of(qwen3_vl_moe_dir, pipeline_parallel_size=2, hf_overrides={"priortr": {**settings, "layer": 1}})


def test_internvl_chat_model_is_refused_with_its_reason():
    """vLLM's InternVLChatModel (InternVL's original layout) needs the checkpoint's remote code, for which
    priortr.apply has no adapter: with priortr settings it is refused at engine start, saying so and
    naming the Hugging Face format the plug-in serves; without them vLLM's hook runs as before."""
    load_general_plugins()
    hook = MODELS_CONFIG_MAP["InternVLChatModel"]
    with_settings = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(priortr={}), architecture="InternVLChatModel")
    )
    with pytest.raises(ValueError, match=r"remote code.*InternVLForConditionalGeneration"):
        hook.verify_and_update_config(with_settings)
    stock = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(), architecture="X"))
    hook.verify_and_update_config(stock)
    assert "InternVLForConditionalGeneration" not in UNSERVED


def test_each_familys_hook_reads_the_rope_kind_from_its_model_class():
    """The config hook of a served family takes the family's layout from its plug-in model class (the
    one place the rope kind is stated): a 1-D RoPE family's served config gets per-request positions on
    all three M-RoPE channels, an M-RoPE family's keeps its own sections, a stock config neither."""
    load_general_plugins()
    sections = {}
    for family in FAMILIES:
        hook = MODELS_CONFIG_MAP[family.architecture]
        assert hook.layout is family.model.layout, family.architecture
        served = SimpleNamespace(hf_config=SimpleNamespace(priortr={"method": "priortr", "budget": 4}))
        served.hf_config.get_text_config = lambda: SimpleNamespace(num_hidden_layers=4)
        hook.verify_and_update_model_config(served)
        sections[family.architecture] = getattr(served.hf_config, "mrope_section", None)
        stock = SimpleNamespace(hf_config=SimpleNamespace())
        hook.verify_and_update_model_config(stock)
        assert not hasattr(stock.hf_config, "mrope_section"), family.architecture
    linear = sections["LlavaForConditionalGeneration"]
    assert linear is not None and sections["Mistral3ForConditionalGeneration"] == linear
    assert sections["Qwen2VLForConditionalGeneration"] is None  # negative control: M-RoPE is left alone


def test_unserved_hook_keeps_vllms_own_hook():
    """The refusing hook runs vLLM's own hook for the architecture, and wraps it once however often the
    plug-in registers."""
    seen = []

    class Own(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config):
            seen.append(vllm_config)

    hook = unserved_hook(Own, "a reason")
    assert issubclass(hook, UnservedFamilyHook) and unserved_hook(hook, "another reason") is hook
    stock = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(), architecture="X"))
    hook.verify_and_update_config(stock)
    assert seen == [stock]


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
        ({"method": "downsample"}, "by grid, which the vLLM plug-in does not gather"),
        ({"method": "prumerge", "options": {"adaptive": True}}, r"adaptive=True keeps as many tokens"),
        ({"method": "prumerge+", "options": {"adaptive": True}}, r"serve adaptive=False"),
        ({"method": "sparsevlm"}, "sparsevlm may merge tokens"),
        ({"method": "pdrop", "request_budgets": [4]}, 'prunes at several layers.*drop "request_budgets"'),
        ({"method": "priortr", "stages": [[1, 8], [2, 4]], "request_budgets": [4]}, "several layers"),
        ({"method": "dart", "stages": [[1, 8], [2, 4]]}, "final_norm, keys evidence"),
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
    assert request_config(config, {"budget": 64}) is config  # the engine's own budget
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
    for unlisted in [16, 1, 0.25]:  # no list: the engine's budget only (default deny)
        with pytest.raises(ValueError, match=r"its own budget \(64\) and grants requests no other"):
            request_config(config, {"budget": unlisted})
    for bad in [
        {"request_budgets": []},
        {"request_budgets": [0]},
        {"request_processor_kwargs": "max_pixels"},
        {"request_media_io_kwargs": "video.num_frames"},
        {"request_media_io_kwargs": ["num_frames"]},
        {"request_media_io_kwargs": ["video."]},
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


def test_request_media_io_kwargs_are_refused_unless_granted():
    """--trust-request-mm-kwargs also opens per-request media_io_kwargs (vLLM 0.33:
    vllm/entrypoints/generate/base/protocol.py:72-97; they reach the processor as
    ProcessorInputs.media_io_kwargs, vllm/multimodal/processing/inputs.py:30, in 0.32 too): a value
    other than the operator's is refused unless the priortr settings grant it."""
    requested = {"image": {"rgba_background_color": [0, 0, 0]}}
    with pytest.raises(
        ValueError, match=r"no media_io_kwargs from a request; got image\.rgba_background_color"
    ):
        check_request_media(requested, {}, RequestPolicy())
    with pytest.raises(ValueError, match="rgba_background_color"):
        check_request_media(requested, {"image": {"rgba_background_color": [9, 9, 9]}}, RequestPolicy())
    check_request_media(requested, {"image": {"rgba_background_color": [0, 0, 0]}}, RequestPolicy())
    granted = request_policy({"request_media_io_kwargs": ["image.rgba_background_color"]})
    check_request_media(requested, {}, granted)
    with pytest.raises(ValueError, match=r"got video\.num_frames"):
        check_request_media({"video": {"num_frames": 4}}, {}, granted)
    check_request_media({}, {"video": {"num_frames": 8}}, RequestPolicy())  # nothing of the request's


def test_gemma3_is_refused_with_its_reason(gemma3_dir):
    """Gemma 3 with priortr settings is refused at engine start, naming both reasons (the sliding window
    counted over cache slots, no bidirectional image masks on CPU: test_gemma3.py shows the second on
    stock vLLM); without them it starts as vLLM's own model."""
    with pytest.raises(
        ValueError,
        match=r"does not serve Gemma3ForConditionalGeneration \(its sliding-window layers .* cache slots .* "
        r"bidirectional masks",
    ):
        config_of(gemma3_dir)
    config_of(gemma3_dir, hf_overrides={})


def test_qwen3_5_with_priortr_settings_is_refused(tmp_path):
    """Qwen3.5 MoE, which vLLM's CPU build serves stock (in bfloat16, with Gated DeltaNet heads of
    128), is pruned by priortr.apply, not by the plug-in: refused with the reason; it was served
    unpruned on 5ac03a6, since no hook was installed for it. Without priortr settings it is vLLM's."""
    from tests.helpers.tiny_qwen3_5 import moe_config

    moe_config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"does not serve Qwen3_5MoeForConditionalGeneration \(its Gated"):
        config_of(tmp_path, dtype="bfloat16", hf_overrides={"priortr": {"method": "priortr", "budget": 4}})
    config_of(tmp_path, dtype="bfloat16", hf_overrides={})


def test_any_other_architecture_with_priortr_settings_is_refused(tmp_path):
    """A model no family of the library covers (a text-only Llama) with priortr settings is refused,
    naming the served architectures, instead of being served unpruned (as it was on 5ac03a6)."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"does not serve LlamaForCausalLM \(it serves only LlavaFor"):
        config_of(tmp_path)
    config_of(tmp_path, hf_overrides={})
