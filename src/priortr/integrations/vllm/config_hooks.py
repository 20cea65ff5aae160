"""Engine settings a pruning model cannot serve exactly, refused when the engine starts, and the
scheduler it is served with.

vLLM calls a model architecture's config hook (``MODELS_CONFIG_MAP``) while it builds its config;
these hooks act only when the model config carries ``priortr`` settings. Each refusal names the
setting to change: a garbled answer is never an option. An engine that starts is given the plug-in's
scheduler (``scheduler.py``: a pruned prompt whole in one step and off the prefix cache, so prefix
caching and chunked prefill stay on), and its model config the longest prompt one step holds, which
the processor checks pruned prompts against.

Compiled models and CUDA graphs are served where every step with a pruned prompt still calls the
model's Python ``forward`` (docs/serving.md, Compiled models and CUDA graphs): vLLM compiles the
language model (its ``@support_torch_compile`` module), which decode and unpruned steps run, while a
pruned step runs the layers one by one. What would replay or compile ``forward`` itself is refused.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import vllm
from packaging.version import Version
from vllm import envs
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.distributed.utils import get_pp_indices
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from priortr.adapters.qwen3_vl import deepstack_layers
from priortr.engine.config import BEFORE_LLM, check_injection
from priortr.engine.front_door import last_stage
from priortr.integrations.vllm.guard import SettingsGuard
from priortr.integrations.vllm.positions import FamilyLayout
from priortr.integrations.vllm.settings import STEP_LIMIT_KEY, WHOLE_LIMIT_KEY, served_settings

logger = logging.getLogger(__name__)
SCHEDULER = "priortr.integrations.vllm.scheduler.PruningScheduler"
"""The scheduler a pruning model is served with (``scheduler.py``), named so that vLLM imports it
where it schedules, not in every process that reads the config."""
BREAKABLE_GRAPHS = "VLLM_USE_BREAKABLE_CUDAGRAPH"
"""vLLM's switch of breakable CUDA graphs, which replay a captured whole-model step. vLLM turns it on
by itself after the config hooks run, for some architectures or under batch-invariant mode, unless
it is set (vLLM 0.33: ``vllm/config/vllm.py:842-862``, run at ``:1793``, after the hooks at
``:1539``; 0.34 resolves ``CompilationConfig.use_breakable_cudagraph`` from it the same way,
``vllm/config/vllm.py:810-834``, after the hooks at ``:1483``); a pruning model's hook sets it to
``0``, vLLM's opt-out, where it is unset."""
LINEAR_ROPE_CHANNELS = [1, 1, 1]
"""A 3-channel M-RoPE layout declared on a 1-D RoPE model's top-level config, so that vLLM keeps
per-request positions for it (``positions.py``); its language model still builds plain RoPE."""


THRESHOLD_NEEDS_CHUNKING = Version(vllm.__version__).release >= (0, 34)
"""Whether this vLLM applies ``long_prefill_token_threshold`` only with chunked prefill on: from 0.34
(``vllm/v1/core/sched/scheduler.py:775-779``, ``vllm/config/scheduler.py:90-93``); 0.32 and 0.33 cut a
long prefill to it with chunked prefill off too (0.33: ``scheduler.py:759-763``)."""


def step_limit(scheduler_config: Any, threshold_needs_chunking: bool = THRESHOLD_NEEDS_CHUNKING) -> int:
    """The longest prompt vLLM schedules in one step: ``max_num_batched_tokens``, or a positive
    ``long_prefill_token_threshold`` below it where this vLLM applies it (it cuts a longer prefill to it
    whenever another request waits or runs; from 0.34 only with chunked prefill on,
    ``THRESHOLD_NEEDS_CHUNKING``). A pruned prompt must fit (``scheduler.py``)."""
    limit = scheduler_config.max_num_batched_tokens
    threshold = scheduler_config.long_prefill_token_threshold
    if threshold_needs_chunking and not scheduler_config.enable_chunked_prefill:
        return limit
    return min(limit, threshold) if threshold > 0 else limit


MEMORY_UTILIZATION = 0.92
"""The share of the GPU's memory a pruning engine sizes its KV cache within when the user sets no memory
policy (``memory_policy``): vLLM's default up to 0.33, under which the plug-in's memory argument was made
(docs/serving.md, "Memory")."""


def memory_policy(cache_config: Any) -> str | None:
    """Choose the engine's memory sizing on purpose where the user left it to vLLM, and say what was
    chosen (None where nothing was left unset).

    From vLLM 0.34 an unset ``gpu_memory_utilization`` is None and means 1.0 with the extensible KV cache
    (the default on CUDA and ROCm), which sizes the cache from the peak of stock warm-up steps plus
    ``max(1 GiB, 0.75 x peak)`` (``vllm/config/cache.py:216-234,495-501``,
    ``vllm/v1/worker/extensible_kv_cache.py:55-74,280-298``), a margin that no step of the plug-in's is in:
    a pruned step's layers 0..L over its whole prompts run outside the profile. Here the sizing becomes
    0.33's: ``MEMORY_UTILIZATION`` and the KV cache sized from the start-up profile, not extended after
    warm-up, so that a fixed share of the card stays beside the KV cache. An explicit
    ``gpu_memory_utilization``, ``kv_cache_memory_bytes`` or ``enable_extensible_kv_cache`` is the user's
    and is kept. On 0.32/0.33 the setting is never unset (its default is 0.92) and nothing changes."""
    if cache_config.gpu_memory_utilization is not None or cache_config.kv_cache_memory_bytes is not None:
        return None
    cache_config.gpu_memory_utilization = MEMORY_UTILIZATION
    chosen = f"gpu_memory_utilization={MEMORY_UTILIZATION}"
    if getattr(cache_config, "enable_extensible_kv_cache", False) is None:
        cache_config.enable_extensible_kv_cache = False
        chosen += " and the extensible KV cache off"
    return chosen


def whole_prompt_limit(scheduler_config: Any) -> int:
    """The most tokens of whole (unpruned) prompts a step runs through layers 0..L: the scheduler's token
    budget, ``max_num_scheduled_tokens`` where set, else ``max_num_batched_tokens`` (vLLM 0.33:
    ``vllm/v1/core/sched/scheduler.py:139-143``), which is at most what the start-up memory profile runs
    through every layer (``max_num_batched_tokens``)."""
    scheduled = scheduler_config.max_num_scheduled_tokens
    return scheduled if scheduled is not None else scheduler_config.max_num_batched_tokens


def refusals(vllm_config: Any) -> list[str]:
    """What in ``vllm_config`` a pruning model cannot serve exactly, one line per setting."""
    out = []
    scheduler = vllm_config.scheduler_config
    features = vllm_config.cache_config.enable_prefix_caching or scheduler.enable_chunked_prefill
    if scheduler.scheduler_cls not in (None, SCHEDULER) and features:
        out.append(
            f"scheduler class {scheduler.scheduler_cls}: with prefix caching or chunked prefill on, a "
            "pruned prompt must be scheduled whole and off the prefix cache, which the plug-in's "
            "scheduler does; drop --scheduler-cls, or pass --no-enable-prefix-caching "
            "--no-enable-chunked-prefill"
        )
    out += compiled_refusals(vllm_config)
    out += pipeline_refusals(vllm_config)
    out += splitting_refusals(vllm_config)
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding: drafts are not pruned alike; drop --speculative-config")
    if vllm_config.kv_transfer_config is not None or vllm_config.cache_config.kv_offloading_size:
        out.append(
            "KV connectors / KV offloading: an external cache hit hands a prompt over in pieces and "
            "skips layers 0..L; drop --kv-transfer-config and --kv-offloading-size"
        )
    if vllm_config.ec_transfer_config is not None:
        out.append(
            "encoder-cache transfer: another instance's encoder outputs are not the N rows per image the "
            "plug-in keeps; drop --ec-transfer-config"
        )
    if vllm_config.lora_config is not None:
        out.append(
            "LoRA: adapter weights change layers 0..L, which the plug-in runs outside vLLM's LoRA "
            "kernels; drop --enable-lora"
        )
    if vllm_config.compilation_config.cudagraph_mm_encoder:
        out.append(
            "encoder CUDA graphs: they replay the vision encoder outside embed_multimodal, which packs "
            "each image's N rows; drop cudagraph_mm_encoder from --compilation-config"
        )
    multimodal = vllm_config.model_config.multimodal_config
    if multimodal is not None and multimodal.mm_processor_cache_type == "shm":
        out.append(
            "shared-memory processor cache: it stores an image's item before the plug-in adds the "
            "request's prompt length to it, which a re-prefill after preemption reads; pass "
            "--mm-processor-cache-type lru"
        )
    if multimodal is not None and multimodal.video_pruning_rate:
        out.append(
            "video pruning: vLLM then appends position channels to image embeddings, which the "
            "plug-in's packing does not expect; drop --video-pruning-rate"
        )
    return out


def pipeline_refusals(vllm_config: Any) -> list[str]:
    """Pipeline parallelism with the scored layer past the first stage: the first stage plans a pruned
    step (it alone embeds the step) and sends the kept tokens' positions on (``pipeline.py``), so the
    scored layer must be one of its layers (vLLM's split, ``get_pp_indices``, which reads
    ``VLLM_PP_LAYER_PARTITION``)."""
    stages = vllm_config.parallel_config.pipeline_parallel_size
    if stages == 1:
        return []
    hf_config = vllm_config.model_config.hf_config
    config = served_settings(hf_config).config
    n_layers = hf_config.get_text_config().num_hidden_layers
    # the deepest layer a stage reads: its scored layer, or the next one for a method ranking by it
    layer = last_stage(config, n_layers) + int("next_attention" in config.method.needs)
    _, end = get_pp_indices(n_layers, 0, stages)
    if layer < end:
        return []
    return [
        f"pipeline parallelism with the scored layer {layer} past the first stage (layers 0..{end - 1}): "
        "the first stage plans a pruned step and makes the cut; pass a smaller --pipeline-parallel-size, "
        f"or set VLLM_PP_LAYER_PARTITION so that the first stage holds layers 0..{layer}"
    ]


def splitting_refusals(vllm_config: Any) -> list[str]:
    """The settings that split a step, or a prompt, across ranks or micro-batches, or that promise
    numerics a pruned step does not keep: a pruned prompt's layers 0..L, its scores and its cut are
    planned for the whole prompt and the whole step on every rank."""
    parallel = vllm_config.parallel_config
    out = []
    if parallel.prefill_context_parallel_size > 1 or parallel.decode_context_parallel_size > 1:
        out.append(
            "context parallelism: prefill context parallelism splits a prompt's rows across ranks and "
            "decode context parallelism splits its KV cache, while a pruned prompt's layers 0..L, scores "
            "and cut need the whole prompt on every rank; pass --prefill-context-parallel-size 1 "
            "--decode-context-parallel-size 1 (--tensor-parallel-size is served)"
        )
    if parallel.use_ubatching:
        out.append(
            "micro-batching (dual-batch overlap): it runs a step as micro-batches, each calling the model "
            "on part of the step's rows, while a pruned prompt's prefill is planned for the whole step; "
            "drop --enable-dbo and --ubatch-size"
        )
    if envs.VLLM_BATCH_INVARIANT:
        out.append(
            "batch-invariant mode (VLLM_BATCH_INVARIANT=1): it promises each request the same numerics "
            "whatever shares its step, while a step with a pruned prompt runs every row through the "
            "layers one by one outside the compiled model, and the pruned prompt's layers 0..L through "
            "SDPA (and under it vLLM may turn breakable CUDA graphs on after these checks); unset "
            "VLLM_BATCH_INVARIANT"
        )
    return out


def compiled_refusals(vllm_config: Any) -> list[str]:
    """The compilation and CUDA-graph settings that would run a step with a pruned prompt without the
    model's Python ``forward``: stock torch.compile of the whole model (``forward`` plans on the host),
    FULL CUDA graphs for batches with prefills (a replay of a captured stock step), and vLLM's
    breakable CUDA graphs (they wrap the whole model for piecewise replay)."""
    if vllm_config.model_config.enforce_eager:
        return []
    compilation = vllm_config.compilation_config
    out = []
    if compilation.mode == CompilationMode.STOCK_TORCH_COMPILE:
        out.append(
            "stock torch.compile of the whole model (compilation mode 1): the plug-in's forward plans a "
            "pruned step on the host; leave the compilation mode at vLLM's default (-O3) or pass "
            "--enforce-eager"
        )
    graphs = compilation.cudagraph_mode
    if graphs is not None and graphs.mixed_mode() == CUDAGraphMode.FULL:
        out.append(
            f"cudagraph_mode {graphs.name}: a batch with a prefill would replay a captured stock step and "
            "skip the pruned prefill; pass FULL_AND_PIECEWISE (vLLM's default), FULL_DECODE_ONLY, "
            "PIECEWISE or NONE in --compilation-config"
        )
    no_piecewise = graphs in (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY)
    if envs.VLLM_USE_BREAKABLE_CUDAGRAPH and not no_piecewise:
        out.append(
            "breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1): they capture the whole model's "
            "forward and would replay a stock step for a pruned prefill; unset VLLM_USE_BREAKABLE_CUDAGRAPH"
        )
    return out


class PruningConfigHook(VerifyAndUpdateConfig):
    """Refuse what cannot be served exactly; keep vLLM from turning breakable CUDA graphs on after
    the checks (``BREAKABLE_GRAPHS``); serve with the plug-in's scheduler; give a 1-D RoPE model
    per-request positions. ``layout`` is the family's (``served_families.Family.layout``), set per family by
    ``for_layout``, so that the rope kind is read where the family's facts live."""

    layout: FamilyLayout

    @classmethod
    def for_layout(cls, layout: FamilyLayout) -> type:
        """This hook for a family that lays images out as ``layout``."""
        return type(cls.__name__, (cls,), {"layout": layout})

    @classmethod
    def verify_and_update_model_config(cls, model_config: Any) -> None:
        hf_config = model_config.hf_config
        if served_settings(hf_config) is not None and cls.layout.linear_rope:
            hf_config.mrope_section = LINEAR_ROPE_CHANNELS

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        if served_settings(vllm_config.model_config.hf_config) is None:
            return
        problems = refusals(vllm_config)
        if problems:
            raise ValueError(
                "priortr cannot prune exactly with these vLLM settings:\n- " + "\n- ".join(problems)
            )
        os.environ.setdefault(BREAKABLE_GRAPHS, "0")
        scheduler = vllm_config.scheduler_config
        if scheduler.scheduler_cls is None:
            scheduler.scheduler_cls = SCHEDULER
        setattr(vllm_config.model_config.hf_config, STEP_LIMIT_KEY, step_limit(scheduler))
        if served_settings(vllm_config.model_config.hf_config).config.stage_layer != BEFORE_LLM:
            # a method pruning before the LLM runs no layer on the whole prompt (pre_llm.py)
            setattr(vllm_config.model_config.hf_config, WHOLE_LIMIT_KEY, whole_prompt_limit(scheduler))
        chosen = memory_policy(vllm_config.cache_config)
        if chosen is not None:
            logger.info(
                "priortr: no memory setting given, so the engine runs with %s: a pruned step's layers "
                "0..L over whole prompts need room beside the KV cache that vLLM's warm-up does not "
                "measure (docs/serving.md, Memory); pass --gpu-memory-utilization to choose",
                chosen,
            )


class DeepStackConfigHook(PruningConfigHook):
    """Qwen3-VL: also refuse a scored layer before the last DeepStack injection, as ``priortr.apply``
    does (the features of decoder layers 0..J-1 are added to every visual token before the cut)."""

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        PruningConfigHook.verify_and_update_config(vllm_config)
        hf_config = vllm_config.model_config.hf_config
        served = served_settings(hf_config)
        if served is not None:
            n_layers = hf_config.get_text_config().num_hidden_layers
            check_injection(served.config, deepstack_layers(hf_config.vision_config, n_layers), n_layers)


class UnservedFamilyHook(SettingsGuard):
    """An architecture the plug-in does not serve (``architectures.UNSERVED``, or any other vLLM knows,
    with ``reason``): vLLM would build its own class and never read the ``priortr`` settings, serving
    the model unpruned, so a config carrying them is refused when the engine starts. vLLM's own hook
    for the architecture (``previous``) runs as before; a config without ``priortr`` settings is
    untouched."""

    reason: str

    @classmethod
    def refusal(cls, architecture: str) -> str:
        return (
            f"priortr's vLLM plug-in does not serve {architecture} ({cls.reason}; docs/serving.md, "
            "Families): with these priortr settings it would be served unpruned; drop them to serve it "
            "unpruned, or prune it with priortr.apply on Hugging Face transformers"
        )


def unserved_hook(previous: type[VerifyAndUpdateConfig] | None, reason: str) -> type[SettingsGuard]:
    """The refusing hook, giving ``reason``, over vLLM's own hook ``previous`` (None: it has none);
    idempotent, as every vLLM process registers the plug-in."""
    if previous is not None and issubclass(previous, UnservedFamilyHook):
        return previous
    return type("UnservedFamilyHook", (UnservedFamilyHook,), {"previous": previous, "reason": reason})


def moe_refusals(vllm_config: Any) -> list[str]:
    """What a mixture-of-experts language model (Qwen3-VL MoE) is not served with.

    Tensor parallelism is served: every tensor-parallel rank holds the same step, so it makes the same
    MoE block calls (a pruned prompt whole, then the step's rows) in the same order, and each call's
    all-reduce pairs with the same call on the other ranks (run at 2 on the CPU build,
    ``tests/vllm/test_moe_parallel.py``). Data and expert parallelism are refused: their MoE blocks
    dispatch rows across ranks, sized by the forward context's ``dp_metadata`` (vLLM 0.32:
    ``distributed/device_communicators/all2all.py:88-112``, ``AgRsAll2AllManager``), which a rank's
    pruned prompt run whole would break, and vLLM's CPU build runs neither even for a stock step, so
    no fix can be run here (docs/serving.md, Scale out). Load balancing and returned routed experts
    would count, or miss, a pruned prompt's routing of layers 0..L."""
    parallel = vllm_config.parallel_config
    out = []
    if parallel.data_parallel_size > 1 or parallel.enable_expert_parallel:
        out.append(
            "data or expert parallelism of a mixture-of-experts model: its MoE blocks dispatch rows "
            "across ranks sized by what each rank announced for the step, and data-parallel ranks step "
            "in lockstep, which a pruned prompt's layers 0..L, run whole on one rank, would break; not "
            "run with the plug-in (vLLM's CPU build runs neither for a stock step), so pass "
            "--data-parallel-size 1 and drop --enable-expert-parallel (--tensor-parallel-size is served)"
        )
    if parallel.enable_eplb:
        out.append(
            "expert load balancing: a pruned prefill's layers 0..L route the whole prompt once more, "
            "which the load statistics would count; drop --enable-eplb"
        )
    if vllm_config.aux_output_config.enable_return_routed_experts:
        out.append(
            "returning routed experts: a pruned prompt's routing of layers 0..L is computed outside the "
            "step's rows and would not be recorded per kept token; drop --enable-return-routed-experts"
        )
    return out


class MoeDeepStackConfigHook(DeepStackConfigHook):
    """Qwen3-VL MoE: Qwen3-VL's refusals and ``moe_refusals``; and vLLM's ``fast_moe_cold_start`` off,
    whose fused-MoE layers find their weights by call order within a step (on torch < 2.11), which a
    pruned step's extra calls would shift onto other layers' experts (vLLM turns it off for Ernie 4.5
    VL's conditional MoE branches alike; it only shortens compilation)."""

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        if served_settings(vllm_config.model_config.hf_config) is None:
            return
        problems = moe_refusals(vllm_config)
        if problems:
            raise ValueError(
                "priortr cannot prune exactly with these vLLM settings:\n- " + "\n- ".join(problems)
            )
        DeepStackConfigHook.verify_and_update_config(vllm_config)
        vllm_config.compilation_config.fast_moe_cold_start = False
