"""The KV cache as priortr operates on it: lengths, and per-layer operations keyed by the layer's type.

transformers' caches are a list of per-layer objects (``cache.layers``); each layer type keeps its keys
and values its own way. Pruning needs three operations on a layer: ``compact`` (keep some of the
prompt's entries, in place, during the prefill), and ``guard`` / ``unguard`` (a pruned cache's first
layer refuses calls no attached engine claimed; see ``priortr.engine.ledger``). ``LAYER_OPERATIONS``
maps each layer type priortr can prune to them; a cache with any other layer type in the pruned layers
is refused (``check_prunable``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticLayer

from priortr.compat.calls import CACHE_NAMES
from priortr.compat.release import refuse
from priortr.surgery import gather_sequence

CLAIMED = "_priortr_claimed"

UNCLAIMED = (
    "this KV cache was pruned by priortr, and no priortr pruning is attached to the model continuing it "
    "(the handle was removed, or the cache went to another model): the stock model would read it with "
    "wrong positions. Continue it with priortr.apply(model, ...) attached (any method: the cache carries "
    "what it needs), or start a new cache"
)


def _compact_dynamic(layer: Any, index: torch.Tensor, seq_len: int) -> None:
    """New, shorter key and value tensors holding positions ``index`` [B, S']."""
    layer.keys = gather_sequence(layer.keys, index, dim=2)
    layer.values = gather_sequence(layer.values, index, dim=2)


def _compact_static(layer: Any, index: torch.Tensor, seq_len: int) -> None:
    """Kept entries move to the front of the preallocated storage (its address stays, for CUDA graphs),
    the rest of the prompt's slots are zeroed, and the filled length drops to S'."""
    if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
        refuse("a static cache layer keeps no cumulative_length tensor")
    kept = index.shape[1]
    for store in (layer.keys, layer.values):
        moved = gather_sequence(store[:, :, :seq_len], index, dim=2)
        store[:, :, :kept].copy_(moved)
        store[:, :, kept:seq_len].zero_()
    layer.cumulative_length.fill_(kept)


def _guarded(plain: type, name: str) -> type:
    """A subclass of the cache layer class ``plain`` for the first layer of a pruned cache: ``update``
    runs only in a call that an attached engine claimed. (A direct subclass, so that an existing layer's
    class can be swapped in place; module-level names, so that it pickles.)"""

    class Guarded(plain):
        __slots__ = ()
        _priortr_claimed = False

        def update(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self._priortr_claimed:
                raise ValueError(UNCLAIMED)
            self._priortr_claimed = False
            return super().update(*args, **kwargs)

        def reset(self) -> None:
            """An emptied cache stands for no pruned prompt any more (static caches reused by generate())."""
            super().reset()
            unguard(self)

    Guarded.__name__ = Guarded.__qualname__ = name
    Guarded.__doc__ = f"A ``{plain.__name__}`` holding the first layer of a pruned cache (``ledger``)."
    return Guarded


GuardedDynamicLayer = _guarded(DynamicLayer, "GuardedDynamicLayer")
GuardedStaticLayer = _guarded(StaticLayer, "GuardedStaticLayer")


@dataclass(frozen=True)
class LayerOperations:
    """What priortr does to one type of cache layer: ``compact(layer, index [B, S'], prompt length)``,
    and the guarded subclass its first layer becomes once the prefill is pruned; ``static``: its slots
    are preallocated (keys span ``max_cache_len`` in every call, and its length is a device tensor)."""

    compact: Callable[[Any, torch.Tensor, int], None]
    guarded: type
    static: bool


LAYER_OPERATIONS: dict[type, LayerOperations] = {
    DynamicLayer: LayerOperations(_compact_dynamic, GuardedDynamicLayer, static=False),
    StaticLayer: LayerOperations(_compact_static, GuardedStaticLayer, static=True),
}
_PLAIN = {operations.guarded: plain for plain, operations in LAYER_OPERATIONS.items()}


def _operations(layer: Any) -> LayerOperations | None:
    kind = type(layer)
    return LAYER_OPERATIONS.get(_PLAIN.get(kind, kind))


def layers(cache: Any) -> list:
    return list(cache.layers)


def first_layer(cache: Any) -> Any:
    """Layer 0 of the cache: every forward pass updates it first. None while a lazy cache has none."""
    return cache.layers[0] if cache.layers else None


def length(cache: Any) -> int | torch.Tensor:
    """Tokens in the cache: an int, or for a static cache a device tensor (reading it blocks the host)."""
    return cache.get_seq_length()


def host_length(cache: Any) -> int | None:
    """Tokens in the cache when the host knows them without reading the device; None for static caches."""
    tokens = cache.get_seq_length()
    return tokens if isinstance(tokens, int) else None


def is_static(cache: Any) -> bool:
    """Whether the cache preallocates its slots (keys span ``max_cache_len`` in every layer call)."""
    if cache is None:
        return False
    return any(operations.static for operations in map(_operations, layers(cache)) if operations)


def check_prunable(cache: Any, layer: int) -> None:
    """Refuse caches whose layers ``0 .. layer`` cannot be compacted (sliding windows, quantised or
    offloaded caches)."""
    for index, cache_layer in enumerate(layers(cache)[: layer + 1]):
        if _operations(cache_layer) is None:
            kinds = ", ".join(kind.__name__ for kind in LAYER_OPERATIONS)
            raise ValueError(
                f"cache layer {index} is a {type(cache_layer).__name__}; priortr can prune only {kinds} "
                "layers (use cache_implementation='dynamic' or 'static')"
            )


def compact(cache: Any, index: torch.Tensor, seq_len: int, n_layers: int) -> None:
    """Keep positions ``index`` [B, S'] (ascending) of the first ``n_layers`` layers' prompt entries."""
    for cache_layer in layers(cache)[:n_layers]:
        if getattr(cache_layer, "keys", None) is None or cache_layer.keys.numel() == 0:
            raise ValueError("cannot prune an empty cache layer; pruning happens during the prefill")
        _operations(cache_layer).compact(cache_layer, index, seq_len)


def guard(cache: Any) -> None:
    """Make the first layer of a pruned ``cache`` refuse calls that no engine claimed."""
    first = first_layer(cache)
    first.__class__ = _operations(first).guarded
    setattr(first, CLAIMED, False)


def unguard(layer: Any) -> None:
    """The plain class again for a guarded cache ``layer`` (nothing for any other layer)."""
    if type(layer) in _PLAIN:
        layer.__class__ = _PLAIN[type(layer)]
        layer.__dict__.pop(CLAIMED, None)


def is_guarded(cache: Any) -> bool:
    return type(first_layer(cache)) in _PLAIN


def claim(cache: Any) -> None:
    """Let the call about to run continue the pruned ``cache`` (its first layer's next update)."""
    setattr(first_layer(cache), CLAIMED, True)


def new(model: Any) -> Any:
    """An empty dynamic cache for ``model``'s language model."""
    return DynamicCache(config=model.config.get_text_config())


def byte_size(cache: Any) -> int:
    """Bytes the cache's keys and values take."""
    return sum(t.numel() * t.element_size() for layer in layers(cache) for t in (layer.keys, layer.values))


def of_output(output: Any) -> Any:
    """The cache a model returned (``output.cache`` from 5.24, ``output.past_key_values`` before)."""
    return next((output[name] for name in CACHE_NAMES if name in output), None)
