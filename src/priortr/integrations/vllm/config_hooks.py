"""Engine settings a pruning model cannot serve exactly, refused when the engine starts, and the
scheduler it is served with.

vLLM calls a model architecture's config hook (``MODELS_CONFIG_MAP``) while it builds its config;
these hooks act only when the model config carries ``priortr`` settings. Each refusal names the
setting to change: a garbled answer is never an option. An engine that starts is given the plug-in's
scheduler (``scheduler.py``: a pruned prompt whole in one step and off the prefix cache, so prefix
caching and chunked prefill stay on), and its model config the longest prompt one step holds, which
the processor checks pruned prompts against.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.config import VerifyAndUpdateConfig

from priortr.integrations.vllm.processor import STEP_LIMIT_KEY, served_config

SCHEDULER = "priortr.integrations.vllm.scheduler.PruningScheduler"
"""The scheduler a pruning model is served with (``scheduler.py``), named so that vLLM imports it
where it schedules, not in every process that reads the config."""
LINEAR_ROPE_CHANNELS = [1, 1, 1]
"""A 3-channel M-RoPE layout declared on a 1-D RoPE model's top-level config, so that vLLM keeps
per-request positions for it (``positions.py``); its language model still builds plain RoPE."""


def step_limit(scheduler_config: Any) -> int:
    """The longest prompt vLLM schedules in one step: ``max_num_batched_tokens``, or a positive
    ``long_prefill_token_threshold`` below it (vLLM cuts a longer prefill to it whenever another
    request waits or runs). A pruned prompt must fit (``scheduler.py``)."""
    limit = scheduler_config.max_num_batched_tokens
    threshold = scheduler_config.long_prefill_token_threshold
    return min(limit, threshold) if threshold > 0 else limit


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
    if not vllm_config.model_config.enforce_eager:
        out.append(
            "torch.compile / CUDA graphs: a pruned step plans on the host between layers; pass "
            "--enforce-eager (LLM(enforce_eager=True))"
        )
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        out.append(
            "tensor / pipeline parallelism: the head-mean scores would need every rank's heads; pass "
            "--tensor-parallel-size 1 --pipeline-parallel-size 1 (scale out with one server per replica)"
        )
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding: drafts are not pruned alike; drop --speculative-config")
    if parallel.data_parallel_size > 1:
        out.append(
            "data parallelism: vLLM pads and synchronises the replicas' steps, which the plug-in's pruned "
            "steps were never run under; pass --data-parallel-size 1 and run one server per replica"
        )
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


class PruningConfigHook(VerifyAndUpdateConfig):
    """Refuse what cannot be served exactly; serve with the plug-in's scheduler; give a 1-D RoPE
    model per-request positions."""

    linear_rope = False

    @classmethod
    def verify_and_update_model_config(cls, model_config: Any) -> None:
        hf_config = model_config.hf_config
        if served_config(hf_config) is not None and cls.linear_rope:
            hf_config.mrope_section = LINEAR_ROPE_CHANNELS

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        if served_config(vllm_config.model_config.hf_config) is None:
            return
        problems = refusals(vllm_config)
        if problems:
            raise ValueError(
                "priortr cannot prune exactly with these vLLM settings:\n- " + "\n- ".join(problems)
            )
        scheduler = vllm_config.scheduler_config
        if scheduler.scheduler_cls is None:
            scheduler.scheduler_cls = SCHEDULER
        setattr(vllm_config.model_config.hf_config, STEP_LIMIT_KEY, step_limit(scheduler))


class LinearRopeConfigHook(PruningConfigHook):
    linear_rope = True
