"""What kind each decoder layer is, as transformers declares it: full attention, a local window (sliding
or chunked), or a layer without attention over the sequence (linear attention, convolution).

transformers names the kinds in ``config.layer_types`` (a config without it has one kind: sliding when it
sets ``sliding_window``, as ``cache_utils.get_layer_types_and_kwargs`` reads it) and keys its cache
layers and masks by them. A local window counts positions of the sequence the layer runs on; priortr
keeps it counting the prompt's own positions after pruning (``Window``, ``docs/families.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

WINDOW_KINDS = {
    "sliding_attention": ("sliding", "sliding_window"),
    "chunked_attention": ("chunked", "attention_chunk_size"),
}
"""transformers' local layer types: (window kind, the config field holding its size)."""

STATE_KINDS = ("linear_attention", "conv", "mamba")
"""Layer types that keep a fixed-size state per sequence instead of per-token keys and values."""


@dataclass(frozen=True)
class Window:
    """A layer's local attention: ``sliding`` (a query sees the keys fewer than ``size`` positions back)
    or ``chunked`` (a query sees the keys of its own block of ``size`` positions), counted in the prompt's
    own text positions."""

    kind: str
    size: int

    def visible(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """Whether keys at text positions ``key`` are in the window of queries at ``query`` (broadcast)."""
        if self.kind == "sliding":
            return query - key < self.size
        return torch.div(query, self.size, rounding_mode="floor") == torch.div(
            key, self.size, rounding_mode="floor"
        )


def types(text_config: Any) -> list[str]:
    """Each decoder layer's type as transformers names it (``full_attention``, ``sliding_attention``,
    ``chunked_attention``, ``linear_attention``, ...)."""
    declared = getattr(text_config, "layer_types", None)
    if declared:
        return list(declared)
    kind = "full_attention" if getattr(text_config, "sliding_window", None) is None else "sliding_attention"
    return [kind] * text_config.num_hidden_layers


def windows(text_config: Any) -> list[Window | None]:
    """Each decoder layer's local window; None for global attention and for layers without attention."""
    out = []
    for kind in types(text_config):
        local = WINDOW_KINDS.get(kind)
        out.append(None if local is None else Window(local[0], getattr(text_config, local[1])))
    return out


def local_types(text_config: Any) -> frozenset[str]:
    """The layer types of ``text_config`` that attend within a local window (sliding or chunked)."""
    return frozenset(kind for kind in types(text_config) if kind in WINDOW_KINDS)
