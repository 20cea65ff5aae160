"""Where the plug-in meets vLLM's registries: model classes, multimodal processors, config hooks."""

from __future__ import annotations

from vllm import ModelRegistry
from vllm.model_executor.models import interns1, llava, llava_onevision, qwen2_5_vl, qwen2_vl, qwen3_vl
from vllm.model_executor.models.config import MODELS_CONFIG_MAP
from vllm.model_executor.models.qwen3_vl_moe import Qwen3VLMoeProcessingInfo
from vllm.multimodal import MULTIMODAL_REGISTRY

from priortr.integrations.vllm.config_hooks import (
    DeepStackConfigHook,
    LinearRopeConfigHook,
    MoeDeepStackConfigHook,
    PruningConfigHook,
    unserved_hook,
)
from priortr.integrations.vllm.models import (
    PruningInternVL,
    PruningLlava,
    PruningLlavaOnevision,
    PruningQwen2_5_VL,
    PruningQwen2VL,
    PruningQwen3VL,
    PruningQwen3VLMoe,
)
from priortr.integrations.vllm.processor import PruningProcessor


class LlavaProcessor(PruningProcessor, llava.LlavaMultiModalProcessor):
    """LLaVA-1.5's processor, pruned requests cut to K placeholders per image."""


class Qwen2VLProcessor(PruningProcessor, qwen2_vl.Qwen2VLMultiModalProcessor):
    """Qwen2-VL's processor, pruned requests cut to K placeholders per image."""


class Qwen2_5_VLProcessor(PruningProcessor, qwen2_5_vl.Qwen2_5_VLMultiModalProcessor):
    """Qwen2.5-VL's processor, pruned requests cut to K placeholders per image."""


class Qwen3VLProcessor(PruningProcessor, qwen3_vl.Qwen3VLMultiModalProcessor):
    """Qwen3-VL's processor, pruned requests cut to K placeholders per image."""


class InternVLProcessor(PruningProcessor, interns1.InternS1MultiModalProcessor):
    """InternVL's processor (Hugging Face format; vLLM's InternS1 processor), pruned requests cut to K
    ``<IMG_CONTEXT>`` placeholders per image between its ``<img>`` and ``</img>``."""


class LlavaOnevisionProcessor(PruningProcessor, llava_onevision.LlavaOnevisionMultiModalProcessor):
    """LLaVA-OneVision's processor, pruned requests cut to K placeholders per image."""


def llava_processor(info: object, dummy_inputs: object) -> object:
    """vLLM's LLaVA processor choice, with the pruning processor for LLaVA-1.5 (CLIP / SigLIP towers)."""
    if isinstance(info, llava.LlavaProcessingInfo):
        return LlavaProcessor(info, dummy_inputs)
    return llava._build_llava_or_pixtral_hf_processor(info, dummy_inputs)


FAMILIES = (
    ("LlavaForConditionalGeneration", PruningLlava, LinearRopeConfigHook),
    ("Qwen2VLForConditionalGeneration", PruningQwen2VL, PruningConfigHook),
    ("Qwen2_5_VLForConditionalGeneration", PruningQwen2_5_VL, PruningConfigHook),
    ("Qwen3VLForConditionalGeneration", PruningQwen3VL, DeepStackConfigHook),
    ("Qwen3VLMoeForConditionalGeneration", PruningQwen3VLMoe, MoeDeepStackConfigHook),
    ("InternVLForConditionalGeneration", PruningInternVL, LinearRopeConfigHook),
    ("LlavaOnevisionForConditionalGeneration", PruningLlavaOnevision, LinearRopeConfigHook),
)
NOT_YET = "no plug-in class wraps its vLLM model yet"
UNSERVED = {
    "InternVLChatModel": (
        "InternVL's original layout, whose config and modeling code are the checkpoint's own remote code "
        "(trust_remote_code), which priortr.apply has no adapter for, so the plug-in's answers could not be "
        "checked against it; serve the Hugging Face format, InternVLForConditionalGeneration (the "
        "OpenGVLab/*-hf checkpoints)"
    ),
    "Gemma3ForConditionalGeneration": NOT_YET,
    "LlavaNextForConditionalGeneration": NOT_YET,
    "Mistral3ForConditionalGeneration": NOT_YET,
    "Idefics3ForConditionalGeneration": NOT_YET,
    "Glm4vForConditionalGeneration": NOT_YET,
    "Llama4ForConditionalGeneration": NOT_YET,
}
"""vLLM architectures of families ``priortr.apply`` prunes and the plug-in does not serve, with the
reason: a config with ``priortr`` settings is refused at engine start instead of being served unpruned
(docs/serving.md)."""


def register_all() -> None:
    """Put the pruning classes under vLLM's architecture names (idempotent: every process calls it)."""
    MULTIMODAL_REGISTRY.register_processor(
        llava_processor,
        info=llava._build_llava_or_pixtral_hf_info,
        dummy_inputs=llava.LlavaDummyInputsBuilder,
    )(PruningLlava)
    MULTIMODAL_REGISTRY.register_processor(
        Qwen2VLProcessor, info=qwen2_vl.Qwen2VLProcessingInfo, dummy_inputs=qwen2_vl.Qwen2VLDummyInputsBuilder
    )(PruningQwen2VL)
    MULTIMODAL_REGISTRY.register_processor(
        Qwen2_5_VLProcessor,
        info=qwen2_5_vl.Qwen2_5_VLProcessingInfo,
        dummy_inputs=qwen2_5_vl.Qwen2_5_VLDummyInputsBuilder,
    )(PruningQwen2_5_VL)
    MULTIMODAL_REGISTRY.register_processor(
        Qwen3VLProcessor, info=qwen3_vl.Qwen3VLProcessingInfo, dummy_inputs=qwen3_vl.Qwen3VLDummyInputsBuilder
    )(PruningQwen3VL)
    MULTIMODAL_REGISTRY.register_processor(
        Qwen3VLProcessor,  # vLLM serves Qwen3-VL MoE with Qwen3-VL's processor too
        info=Qwen3VLMoeProcessingInfo,
        dummy_inputs=qwen3_vl.Qwen3VLDummyInputsBuilder,
    )(PruningQwen3VLMoe)
    MULTIMODAL_REGISTRY.register_processor(
        InternVLProcessor,
        info=interns1.InternS1ProcessingInfo,
        dummy_inputs=interns1.InternS1DummyInputsBuilder,
    )(PruningInternVL)
    MULTIMODAL_REGISTRY.register_processor(
        LlavaOnevisionProcessor,
        info=llava_onevision.LlavaOnevisionProcessingInfo,
        dummy_inputs=llava_onevision.LlavaOnevisionDummyInputsBuilder,
    )(PruningLlavaOnevision)
    for architecture, model, hook in FAMILIES:
        ModelRegistry.register_model(architecture, model)
        MODELS_CONFIG_MAP[architecture] = hook
    for architecture, reason in UNSERVED.items():
        MODELS_CONFIG_MAP[architecture] = unserved_hook(MODELS_CONFIG_MAP.get(architecture), reason)
