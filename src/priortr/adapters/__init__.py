"""Model-family adapters, looked up by ``config.model_type``."""

from __future__ import annotations

from torch import nn

from priortr.adapters.base import FamilyAdapter
from priortr.adapters.gemma3 import Gemma3Adapter
from priortr.adapters.gemma4 import Gemma4Adapter
from priortr.adapters.glm4v import Glm4vAdapter
from priortr.adapters.glm46v import Glm46VAdapter
from priortr.adapters.idefics3 import Idefics3Adapter
from priortr.adapters.internvl import InternVLAdapter
from priortr.adapters.llama4 import Llama4Adapter
from priortr.adapters.llava import LlavaAdapter
from priortr.adapters.llava_next import LlavaNextAdapter, LlavaOnevisionAdapter
from priortr.adapters.llava_onevision1_5 import LlavaOnevision15Adapter
from priortr.adapters.minicpmv import MiniCPMV4_7Adapter, MiniCPMVAdapter
from priortr.adapters.mistral3 import Mistral3Adapter
from priortr.adapters.molmo2 import Molmo2Adapter
from priortr.adapters.qwen2_vl import QwenVLAdapter
from priortr.adapters.qwen3_5 import Qwen3_5Adapter
from priortr.adapters.qwen3_vl import Qwen3VLAdapter
from priortr.adapters.video_llava import VideoLlavaAdapter

_ADAPTERS: dict[str, FamilyAdapter] = {}
_REFUSED: dict[str, str] = {}


def register_adapter(adapter: FamilyAdapter) -> FamilyAdapter:
    """Make a family available to ``priortr.apply``; raises on a model type claimed twice."""
    for model_type in adapter.model_types:
        if model_type in _ADAPTERS:
            raise ValueError(f"model type {model_type!r} already has adapter {_ADAPTERS[model_type].name!r}")
        _ADAPTERS[model_type] = adapter
    return adapter


def register_refusal(model_type: str, reason: str) -> None:
    """Refuse a family priortr knows it cannot prune exactly, naming why (``adapter_for`` raises it,
    ``priortr families`` lists it); raises on a model type that has an adapter or a refusal already."""
    if model_type in _ADAPTERS or model_type in _REFUSED:
        raise ValueError(f"model type {model_type!r} already has an adapter or a refusal")
    _REFUSED[model_type] = reason


def refusals() -> dict[str, str]:
    """Why each refused model type is refused, by model type."""
    return dict(_REFUSED)


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def supported_families() -> list[str]:
    """The names of the registered families (several model types can share one)."""
    return sorted({adapter.name for adapter in _ADAPTERS.values()})


def adapter_for(model: nn.Module) -> FamilyAdapter:
    """The adapter of ``model``'s family, or a ValueError naming the supported families."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in _REFUSED:
        raise ValueError(
            f"priortr does not support {type(model).__name__} (model_type={model_type!r}): "
            f"{_REFUSED[model_type]}"
        )
    if model_type not in _ADAPTERS:
        raise ValueError(
            f"priortr does not support {type(model).__name__} (model_type={model_type!r}); supported "
            f"model types: {', '.join(supported_model_types())}. Pass the *ForConditionalGeneration model."
        )
    return _ADAPTERS[model_type]


def adapter_for_type(model_type: str) -> FamilyAdapter:
    """The adapter registered for a config's ``model_type`` (front ends that hold a config, not a
    transformers model: the vLLM plug-in), or a ValueError naming the supported model types."""
    if model_type in _REFUSED:
        raise ValueError(f"priortr does not support model_type={model_type!r}: {_REFUSED[model_type]}")
    if model_type not in _ADAPTERS:
        raise ValueError(
            f"priortr does not support model_type={model_type!r}; supported model types: "
            f"{', '.join(supported_model_types())}"
        )
    return _ADAPTERS[model_type]


register_adapter(LlavaAdapter())
register_adapter(QwenVLAdapter())
register_adapter(Qwen3VLAdapter())
register_adapter(InternVLAdapter())
register_adapter(Idefics3Adapter())
register_adapter(LlavaNextAdapter())
register_adapter(LlavaOnevisionAdapter())
register_adapter(VideoLlavaAdapter())
register_adapter(Mistral3Adapter())
register_adapter(Glm4vAdapter())
register_adapter(Qwen3_5Adapter())
register_adapter(Gemma3Adapter())
register_adapter(Llama4Adapter())
register_adapter(LlavaOnevision15Adapter())
register_adapter(Glm46VAdapter())
register_adapter(Gemma4Adapter())
register_adapter(MiniCPMVAdapter())
register_adapter(MiniCPMV4_7Adapter())
register_adapter(Molmo2Adapter())

__all__ = [
    "FamilyAdapter",
    "adapter_for",
    "adapter_for_type",
    "refusals",
    "register_adapter",
    "register_refusal",
    "supported_families",
    "supported_model_types",
]
