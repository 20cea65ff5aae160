"""Where the plug-in meets vLLM's registries: model classes, multimodal processors, config hooks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllm import ModelRegistry
from vllm.model_executor.models import (
    interns1,
    llava,
    llava_next,
    llava_onevision,
    mistral3,
    qwen2_5_vl,
    qwen2_vl,
    qwen3_vl,
)
from vllm.model_executor.models.config import MODELS_CONFIG_MAP
from vllm.model_executor.models.qwen3_vl_moe import Qwen3VLMoeProcessingInfo
from vllm.multimodal import MULTIMODAL_REGISTRY

from priortr.integrations.vllm.architectures import UNSERVED
from priortr.integrations.vllm.config_hooks import (
    DeepStackConfigHook,
    MoeDeepStackConfigHook,
    PruningConfigHook,
    unserved_hook,
)
from priortr.integrations.vllm.models import (
    PruningInternVL,
    PruningLlava,
    PruningLlavaNext,
    PruningLlavaOnevision,
    PruningMistral3,
    PruningQwen2_5_VL,
    PruningQwen2VL,
    PruningQwen3VL,
    PruningQwen3VLMoe,
)
from priortr.integrations.vllm.processor import PruningProcessor


class LlavaProcessor(PruningProcessor, llava.LlavaMultiModalProcessor):
    """LLaVA-1.5's processor, pruned requests cut to K placeholders per image (adjacent images: one
    run, one budget, as ``priortr.apply`` prunes them)."""

    adjacent_images = True


class Qwen2VLProcessor(PruningProcessor, qwen2_vl.Qwen2VLMultiModalProcessor):
    """Qwen2-VL's processor, pruned requests cut to K placeholders per image."""


class Qwen2_5_VLProcessor(PruningProcessor, qwen2_5_vl.Qwen2_5_VLMultiModalProcessor):
    """Qwen2.5-VL's processor, pruned requests cut to K placeholders per image."""


class Qwen3VLProcessor(PruningProcessor, qwen3_vl.Qwen3VLMultiModalProcessor):
    """Qwen3-VL's processor, pruned requests cut to K placeholders per image."""


class InternVLProcessor(PruningProcessor, interns1.InternS1MultiModalProcessor):
    """InternVL's processor (Hugging Face format; vLLM's InternS1 processor), pruned requests cut to K
    ``<IMG_CONTEXT>`` placeholders per image between its ``<img>`` and ``</img>``."""


class LlavaNextProcessor(PruningProcessor, llava_next.LlavaNextMultiModalProcessor):
    """LLaVA-NeXT's processor, pruned requests cut to K placeholders per image (adjacent images: one
    run, one budget, as ``priortr.apply`` prunes them)."""

    adjacent_images = True


class LlavaOnevisionProcessor(PruningProcessor, llava_onevision.LlavaOnevisionMultiModalProcessor):
    """LLaVA-OneVision's processor, pruned requests cut to K placeholders per image (adjacent images, as
    its llava-hf chat template writes a message's images: one run, one budget, as ``priortr.apply``
    prunes them)."""

    adjacent_images = True


class Mistral3Processor(PruningProcessor, mistral3.Mistral3MultiModalProcessor):
    """Mistral 3's processor, pruned requests laid out with K ``[IMG]`` slots per image, its row breaks
    and ``[IMG_END]`` after them."""


def llava_processor(info: object, dummy_inputs: object) -> object:
    """vLLM's LLaVA processor choice, with the pruning processor for LLaVA-1.5 (CLIP / SigLIP towers)."""
    if isinstance(info, llava.LlavaProcessingInfo):
        return LlavaProcessor(info, dummy_inputs)
    return llava._build_llava_or_pixtral_hf_processor(info, dummy_inputs)


@dataclass(frozen=True)
class Family:
    """One served architecture: vLLM's name for it, the plug-in's model class, the config hook run on
    its model config, and the multimodal processor registered for the class (a factory or a processor
    class, with vLLM's processing info and dummy inputs builder of the family)."""

    architecture: str
    model: type
    hook: type
    processor: Callable[..., object]
    info: Callable[..., object]
    dummy_inputs: type


FAMILIES = (
    Family(
        "LlavaForConditionalGeneration",
        PruningLlava,
        PruningConfigHook,
        llava_processor,
        llava._build_llava_or_pixtral_hf_info,
        llava.LlavaDummyInputsBuilder,
    ),
    Family(
        "Qwen2VLForConditionalGeneration",
        PruningQwen2VL,
        PruningConfigHook,
        Qwen2VLProcessor,
        qwen2_vl.Qwen2VLProcessingInfo,
        qwen2_vl.Qwen2VLDummyInputsBuilder,
    ),
    Family(
        "Qwen2_5_VLForConditionalGeneration",
        PruningQwen2_5_VL,
        PruningConfigHook,
        Qwen2_5_VLProcessor,
        qwen2_5_vl.Qwen2_5_VLProcessingInfo,
        qwen2_5_vl.Qwen2_5_VLDummyInputsBuilder,
    ),
    Family(
        "Qwen3VLForConditionalGeneration",
        PruningQwen3VL,
        DeepStackConfigHook,
        Qwen3VLProcessor,
        qwen3_vl.Qwen3VLProcessingInfo,
        qwen3_vl.Qwen3VLDummyInputsBuilder,
    ),
    Family(
        "Qwen3VLMoeForConditionalGeneration",
        PruningQwen3VLMoe,
        MoeDeepStackConfigHook,
        Qwen3VLProcessor,  # vLLM serves Qwen3-VL MoE with Qwen3-VL's processor too
        Qwen3VLMoeProcessingInfo,
        qwen3_vl.Qwen3VLDummyInputsBuilder,
    ),
    Family(
        "InternVLForConditionalGeneration",
        PruningInternVL,
        PruningConfigHook,
        InternVLProcessor,
        interns1.InternS1ProcessingInfo,
        interns1.InternS1DummyInputsBuilder,
    ),
    Family(
        "LlavaOnevisionForConditionalGeneration",
        PruningLlavaOnevision,
        PruningConfigHook,
        LlavaOnevisionProcessor,
        llava_onevision.LlavaOnevisionProcessingInfo,
        llava_onevision.LlavaOnevisionDummyInputsBuilder,
    ),
    Family(
        "LlavaNextForConditionalGeneration",
        PruningLlavaNext,
        PruningConfigHook,
        LlavaNextProcessor,
        llava_next.LlavaNextProcessingInfo,
        llava.LlavaDummyInputsBuilder,
    ),
    Family(
        "Mistral3ForConditionalGeneration",
        PruningMistral3,
        PruningConfigHook,
        Mistral3Processor,
        mistral3.Mistral3ProcessingInfo,
        mistral3.Mistral3DummyInputsBuilder,
    ),
)
"""Every served family, one row each: ``register_all`` registers them all alike."""


def register_all() -> None:
    """Put the pruning classes under vLLM's architecture names (idempotent: every process calls it)."""
    for family in FAMILIES:
        MULTIMODAL_REGISTRY.register_processor(
            family.processor, info=family.info, dummy_inputs=family.dummy_inputs
        )(family.model)
        ModelRegistry.register_model(family.architecture, family.model)
        MODELS_CONFIG_MAP[family.architecture] = family.hook.for_model(family.model)
    for architecture, reason in UNSERVED.items():
        MODELS_CONFIG_MAP[architecture] = unserved_hook(MODELS_CONFIG_MAP.get(architecture), reason)
