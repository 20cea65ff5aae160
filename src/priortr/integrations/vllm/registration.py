"""Where the plug-in meets vLLM's registries: every served family's model class, multimodal processor
and config hook (``served_families.FAMILIES``), and a refusing hook on every other architecture vLLM
knows: a config with ``priortr`` settings is never served unpruned (``architectures.UNSERVED`` gives
the reason for families ``priortr.apply`` prunes)."""

from __future__ import annotations

from vllm import ModelRegistry
from vllm.model_executor.models.config import MODELS_CONFIG_MAP
from vllm.multimodal import MULTIMODAL_REGISTRY

from priortr.integrations.vllm.architectures import ANY_OTHER, UNSERVED
from priortr.integrations.vllm.config_hooks import unserved_hook
from priortr.integrations.vllm.served_families import FAMILIES


def register_all() -> None:
    """Put the pruning classes under vLLM's architecture names (idempotent: every process calls it)."""
    for family in FAMILIES:
        MULTIMODAL_REGISTRY.register_processor(
            family.processor, info=family.info, dummy_inputs=family.dummy_inputs
        )(family.model)
        ModelRegistry.register_model(family.architecture, family.model)
        MODELS_CONFIG_MAP[family.architecture] = family.hook.for_layout(family.layout)
    served = {family.architecture for family in FAMILIES}
    for architecture in (set(ModelRegistry.get_supported_archs()) | set(UNSERVED)) - served:
        reason = UNSERVED.get(architecture, ANY_OTHER)
        MODELS_CONFIG_MAP[architecture] = unserved_hook(MODELS_CONFIG_MAP.get(architecture), reason)
