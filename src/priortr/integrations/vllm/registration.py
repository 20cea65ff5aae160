"""Where the plug-in meets vLLM's registries: every served family's model class, multimodal processor
and config hook (``served_families.FAMILIES``), and the refusing hook of every unserved one."""

from __future__ import annotations

from vllm import ModelRegistry
from vllm.model_executor.models.config import MODELS_CONFIG_MAP
from vllm.multimodal import MULTIMODAL_REGISTRY

from priortr.integrations.vllm.architectures import UNSERVED
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
    for architecture, reason in UNSERVED.items():
        MODELS_CONFIG_MAP[architecture] = unserved_hook(MODELS_CONFIG_MAP.get(architecture), reason)
