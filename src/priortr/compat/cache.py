"""The KV cache as priortr operates on it: lengths, and per-layer operations keyed by the layer's type.

transformers' caches are a list of per-layer objects (``cache.layers``); each layer type keeps its keys
and values its own way. Pruning needs three operations on a layer: ``compact`` (keep some of the
prompt's entries during the prefill; a static layer also loses the pruned tokens' slots, so that every
decode step attends over the kept prompt and the generated tokens only, ``restore_slots`` undoing it
for the cache's next prompt), and ``guard`` / ``unguard`` (a pruned cache's first
key-value layer refuses calls no attached engine claimed; see ``priortr.engine.ledger``).
``LAYER_OPERATIONS`` maps each key-value layer type priortr can prune to them: full attention's, and the
window caches of sliding and chunked layers, which keep the tail of what their layer saw. State layers
(``STATE_LAYERS``: linear attention's recurrent and convolution states) hold nothing per token and are
left as they are, but for the count of tokens they saw, which transformers 5.25 keeps on them
(``cumulative_length_linear``) and reads as the cache's length where layer 0 is one (Qwen3.5): it
becomes the kept prompt's length, as the key-value layers'. A cache with any other layer type in the
pruned layers is refused (``check_prunable``). Layers that read another layer's keys (KV sharing) hold
nothing in the cache (``EMPTY_LAYERS``); what they read, the keys and values the model passes from layer
to layer within one forward, is cut as the cache is (``cut_shared``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import cache_utils
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from priortr.compat.calls import CACHE_NAMES, cache_field
from priortr.compat.release import refuse
from priortr.tensors.gathers import gather_sequence

CLAIMED = "_priortr_claimed"
SPOILED = "_priortr_spoiled"

UNCLAIMED = (
    "this KV cache was pruned by priortr, and no priortr pruning is attached to the model continuing it "
    "(the handle was removed, or the cache went to another model): the stock model would read it with "
    "wrong positions. Continue it with priortr.apply(model, ...) attached (any method: the cache carries "
    "what it needs), or start a new cache"
)

SPOILED_MESSAGE = (
    "this pruned cache was already continued once without priortr attached, and that call was refused only "
    "after the model's linear-attention layers before its first attention layer had stepped their states "
    "(Qwen3.5): the cache no longer stands for the conversation. Start a new cache"
)


def _compact_dynamic(layer: Any, index: torch.Tensor, seq_len: int) -> None:
    """New, shorter key and value tensors holding positions ``index`` [B, S']."""
    layer.keys = gather_sequence(layer.keys, index, dim=2)
    layer.values = gather_sequence(layer.values, index, dim=2)


def _compact_static(layer: Any, index: torch.Tensor, seq_len: int) -> None:
    """Kept entries move to the front of new, shorter storage (``_shrink``: the kept prompt and the slots
    after the prompt, so that decode steps read no pruned slot), and the filled length drops to S'."""
    if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
        refuse("a static cache layer keeps no cumulative_length tensor")
    kept = index.shape[1]
    moved = [gather_sequence(store[:, :, :seq_len], index, dim=2) for store in (layer.keys, layer.values)]
    _shrink(layer, seq_len - kept)
    for store, entries in zip((layer.keys, layer.values), moved, strict=True):
        store[:, :, :kept].copy_(entries)
    layer.cumulative_length.fill_(kept)


FULL_LENGTH = "_priortr_full_length"


class ShrunkStaticLayer(StaticLayer):
    """A ``StaticLayer`` that a pruned prefill shortened (``_shrink``): ``reset`` gives it its full length
    back, so that a reset cache is a plain cache again for any model, the stock one included (generate()
    resets a static cache it reuses). A direct subclass, so that a layer's class can be swapped in place;
    module-level, so that it pickles."""

    __slots__ = ()

    def reset(self) -> None:
        super().reset()
        _restore(self)


def _shrink(layer: Any, dropped: int) -> None:
    """A static full-attention layer of ``dropped`` fewer slots (its ``max_cache_len``, hence the keys every
    later call attends over); new zeroed storage at static addresses if it holds any, else its lazy
    allocation will make the shorter one. ``reset`` (``ShrunkStaticLayer``, or the guarded first layer's)
    and ``restore_slots`` give the layer its full length back."""
    if type(layer) is StaticLayer:
        layer.__class__ = ShrunkStaticLayer
    layer.__dict__.setdefault(FULL_LENGTH, layer.max_cache_len)
    layer.max_cache_len -= dropped
    if not layer.is_initialized:
        return
    for name in ("keys", "values"):
        store = getattr(layer, name)
        shrunk = store.new_zeros(*store.shape[:2], layer.max_cache_len, store.shape[3])
        torch._dynamo.mark_static_address(shrunk)  # as the layer's own allocation marks it (CUDA graphs)
        setattr(layer, name, shrunk)


def restore_slots(cache: Any) -> None:
    """Give the static layers a pruned prefill shortened (``_shrink``) their full length back, before a new
    prompt fills the (reset) cache: their storage is made anew, full-length, when they are next written."""
    for layer in key_value_layers(cache):
        _restore(layer)


def _restore(layer: Any) -> None:
    """One layer's full length back (nothing for a layer no pruned prefill shortened); a plain
    ``StaticLayer`` again."""
    full = layer.__dict__.pop(FULL_LENGTH, None)
    if full is not None:
        layer.max_cache_len = full
        layer.is_initialized = False
    if type(layer) is ShrunkStaticLayer:
        layer.__class__ = StaticLayer


def _window_tail(
    index: torch.Tensor, seq_len: int, stored: int, slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a window cache holding the last ``stored`` of ``seq_len`` columns: the slots, in it, of the
    last ``slots`` kept columns ``index`` [B, S'], and which of them it holds. The others are older
    than the window's tail, so out of every later query's window: they stay zero and are never seen."""
    source = index[:, -slots:] - (seq_len - stored)  # [B, n]
    return source.clamp(min=0), source >= 0


def _compact_dynamic_window(layer: Any, index: torch.Tensor, seq_len: int) -> None:
    """A sliding (or chunked) layer's cache keeps the last ``window - 1`` tokens its layer saw: after the
    prune, the last ``window - 1`` kept ones, as if its layer had run on them; its length becomes S'."""
    slots = min(index.shape[1], layer.sliding_window - 1)
    source, held = _window_tail(index, seq_len, layer.keys.shape[2], slots)
    for name in ("keys", "values"):
        kept = gather_sequence(getattr(layer, name), source, dim=2)
        setattr(layer, name, kept * held[:, None, :, None].to(kept.dtype))
    layer.cumulative_length = index.shape[1]


def _compact_static_window(layer: Any, index: torch.Tensor, seq_len: int) -> None:
    """The static window cache (``max_cache_len`` slots holding the last tokens seen, in order) the same
    way, in place; its host-side count of tokens seen becomes S', its slot counter the slots filled."""
    capacity = layer.max_cache_len
    slots = min(index.shape[1], capacity)
    source, held = _window_tail(index, seq_len, min(layer.cumulative_length_int, capacity), slots)
    for store in (layer.keys, layer.values):
        kept = gather_sequence(store, source, dim=2) * held[:, None, :, None].to(store.dtype)
        store[:, :, :slots].copy_(kept)
        store[:, :, slots:].zero_()
    layer.cumulative_length_int = index.shape[1]
    layer.cumulative_length.fill_(slots)


def _guarded(plain: type, name: str) -> type:
    """A subclass of the cache layer class ``plain`` for the first layer of a pruned cache: ``update``
    runs only in a call that an attached engine claimed. (A direct subclass, so that an existing layer's
    class can be swapped in place; module-level names, so that it pickles.)"""

    class Guarded(plain):
        __slots__ = ()
        _priortr_claimed = False

        def update(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self._priortr_claimed:
                setattr(self, SPOILED, True)  # state layers before this one may have stepped already
                raise ValueError(UNCLAIMED)
            self._priortr_claimed = False
            return super().update(*args, **kwargs)

        def reset(self) -> None:
            """An emptied cache stands for no pruned prompt any more (static caches reused by generate())."""
            super().reset()
            _restore(self)  # a static first layer a pruned prefill shortened: full again
            unguard(self)

    Guarded.__name__ = Guarded.__qualname__ = name
    Guarded.__doc__ = f"A ``{plain.__name__}`` holding the first layer of a pruned cache (``ledger``)."
    return Guarded


GuardedDynamicLayer = _guarded(DynamicLayer, "GuardedDynamicLayer")
GuardedStaticLayer = _guarded(StaticLayer, "GuardedStaticLayer")
GuardedDynamicSlidingWindowLayer = _guarded(DynamicSlidingWindowLayer, "GuardedDynamicSlidingWindowLayer")
GuardedStaticSlidingWindowLayer = _guarded(StaticSlidingWindowLayer, "GuardedStaticSlidingWindowLayer")


@dataclass(frozen=True)
class LayerOperations:
    """What priortr does to one type of cache layer: ``compact(layer, index [B, S'], prompt length)``,
    and the guarded subclass its first layer becomes once the prefill is pruned; ``static``: its slots
    are preallocated (keys span ``max_cache_len`` in every call, and its length is a device tensor);
    ``window``: it keeps only a local window's last tokens."""

    compact: Callable[[Any, torch.Tensor, int], None]
    guarded: type
    static: bool
    window: bool = False


LAYER_OPERATIONS: dict[type, LayerOperations] = {
    DynamicLayer: LayerOperations(_compact_dynamic, GuardedDynamicLayer, static=False),
    StaticLayer: LayerOperations(_compact_static, GuardedStaticLayer, static=True),
    DynamicSlidingWindowLayer: LayerOperations(
        _compact_dynamic_window, GuardedDynamicSlidingWindowLayer, static=False, window=True
    ),
    StaticSlidingWindowLayer: LayerOperations(
        _compact_static_window, GuardedStaticSlidingWindowLayer, static=True, window=True
    ),
}

STATE_LAYERS = (LinearAttentionCacheLayerMixin,)
"""Cache layers of a fixed-size state per sequence (linear attention's recurrent and convolution states):
nothing per token to remove. The state of a layer up to the scored one has absorbed every prompt token;
that of a later layer only the kept ones, since its layer ran on them."""
STATE_TOKEN_COUNT = "cumulative_length_linear"
"""A state layer's device count of the tokens it saw (transformers 5.25 on; absent before), which
``Cache.get_seq_length()`` returns when layer 0 is a state layer."""
EMPTY_LAYERS = tuple(kind for kind in (getattr(cache_utils, "DummyLayer", None),) if kind is not None)
"""Cache layers that hold nothing (transformers 5.25's ``DummyLayer``: the slot of a layer that reads
another layer's keys and values, Gemma 4's KV sharing); left as they are. Earlier releases make no
layer for those (``()``)."""
_NO_TOKENS = STATE_LAYERS + EMPTY_LAYERS
_PLAIN = {operations.guarded: plain for plain, operations in LAYER_OPERATIONS.items()}
_BASE = {**_PLAIN, ShrunkStaticLayer: StaticLayer}
"""The layer type whose ``LAYER_OPERATIONS`` apply to a guarded or shortened layer."""


def _operations(layer: Any) -> LayerOperations | None:
    kind = type(layer)
    return LAYER_OPERATIONS.get(_BASE.get(kind, kind))


def layers(cache: Any) -> list:
    return list(cache.layers)


def key_value_layers(cache: Any, count: int | None = None) -> list:
    """The layers among the first ``count`` (all by default) that hold per-token keys and values."""
    return [layer for layer in layers(cache)[:count] if not isinstance(layer, _NO_TOKENS)]


def first_layer(cache: Any) -> Any:
    """The first key-value layer of the cache: every forward pass updates it before any other key-value
    layer. None while a lazy cache has none."""
    return next(iter(key_value_layers(cache)), None)


def length(cache: Any) -> int | torch.Tensor:
    """Tokens in the cache, as its first key-value layer holds them (0 before it has any): an int, or for a
    static cache a device tensor (reading it blocks the host). (``Cache.get_seq_length()`` reads layer 0,
    which from transformers 5.25 may be a state layer whose count is a device tensor.)"""
    first = first_layer(cache)
    return 0 if first is None else first.get_seq_length()


def host_length(cache: Any) -> int | None:
    """Tokens in the cache when the host knows them without reading the device; None for static caches."""
    tokens = length(cache)
    return tokens if isinstance(tokens, int) else None


def key_length(cache: Any, layer: int, tokens: int) -> int:
    """How many keys decoder layer ``layer`` attends over when it runs on ``tokens`` new ones (its cache's
    mask size: every preallocated slot of a static cache). Host arithmetic: nothing is read back."""
    return tokens if cache is None else int(cache.get_mask_sizes(tokens, layer)[0])


def max_length(cache: Any) -> int:
    """The most tokens a static cache's key-value layers hold (their preallocated slots)."""
    return max(int(layer.max_cache_len) for layer in key_value_layers(cache))


def check_prunable(cache: Any, layer: int, local: Sequence[bool] | None = None) -> None:
    """Refuse caches whose layers ``0 .. layer`` cannot be compacted (quantised or offloaded caches), and a
    window cache on a decoder layer that attends globally (``local[i]``: whether layer i has a local
    window; such a cache would drop keys the layer's positions still reach); state layers are left as
    they are."""
    for index, cache_layer in enumerate(layers(cache)[: layer + 1]):
        operations = _operations(cache_layer)
        if operations is None and not isinstance(cache_layer, _NO_TOKENS):
            kinds = ", ".join(kind.__name__ for kind in LAYER_OPERATIONS)
            raise ValueError(
                f"cache layer {index} is a {type(cache_layer).__name__}; priortr can prune only {kinds} "
                "layers (use cache_implementation='dynamic' or 'static')"
            )
        if operations is not None and operations.window and local is not None and not local[index]:
            raise ValueError(
                f"cache layer {index} is a {type(cache_layer).__name__}, which keeps only a window's last "
                f"tokens, but decoder layer {index} attends to every token; pass the model's own cache "
                "(cache_implementation='dynamic' or 'static')"
            )


def compact(cache: Any, index: torch.Tensor, seq_len: int, layers_run: int) -> None:
    """Keep columns ``index`` [B, S'] (the kept tokens in order, after the fillers of ragged rows) of the
    prompt entries of the key-value caches of layers ``0 .. layers_run - 1``, the layers that ran.
    A static cache's compaction runs eagerly in a compiled prefill (one graph break): it swaps its layers'
    classes and marks their new storage as static addresses, which dynamo cannot trace."""
    if any(getattr(_operations(layer), "static", False) for layer in layers(cache)):
        _compact_eagerly(cache, index, seq_len, layers_run)
    else:
        _compact(cache, index, seq_len, layers_run)


def cut_shared(states: Any, index: torch.Tensor, seq_len: int) -> None:
    """Keep columns ``index`` [B, S'] of the ``seq_len`` current columns in every key-value pair that a
    layer stored for later layers of the same forward (Gemma 4's ``shared_kv_states``: what its cache
    update returned, the sequence's columns first, then the unfilled slots of a static cache, which
    follow as they are, as they do in the compacted cache). In place: the later layers read ``states``."""
    for kind, pair in list(states.items()):
        states[kind] = tuple(
            torch.cat([gather_sequence(part[:, :, :seq_len], index, dim=2), part[:, :, seq_len:]], dim=2)
            for part in pair
        )


def _compact(cache: Any, index: torch.Tensor, seq_len: int, layers_run: int) -> None:
    for cache_layer in key_value_layers(cache, layers_run):
        if getattr(cache_layer, "keys", None) is None or cache_layer.keys.numel() == 0:
            raise ValueError("cannot prune an empty cache layer; pruning happens during the prefill")
        _operations(cache_layer).compact(cache_layer, index, seq_len)
    for cache_layer in layers(cache)[:layers_run]:
        if isinstance(getattr(cache_layer, STATE_TOKEN_COUNT, None), torch.Tensor):
            getattr(cache_layer, STATE_TOKEN_COUNT).fill_(index.shape[1])  # in place: a static address
    for cache_layer in layers(cache)[layers_run:]:  # the layers still to run: shorter from the start
        operations = _operations(cache_layer)
        if operations is not None and operations.static and not operations.window:
            _shrink(cache_layer, seq_len - index.shape[1])


_compact_eagerly = torch.compiler.disable(_compact)


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
        layer.__dict__.pop(SPOILED, None)


def is_guarded(cache: Any) -> bool:
    return type(first_layer(cache)) in _PLAIN


def check_unspoiled(cache: Any) -> None:
    """Refuse a pruned ``cache`` whose state layers a refused, unclaimed call may have stepped before its
    first key-value layer refused it (``SPOILED_MESSAGE``)."""
    if getattr(first_layer(cache), SPOILED, False) and any(
        isinstance(layer, STATE_LAYERS) for layer in layers(cache)
    ):
        raise ValueError(SPOILED_MESSAGE)


def claim(cache: Any) -> None:
    """Let the call about to run continue the pruned ``cache`` (its first layer's next update)."""
    setattr(first_layer(cache), CLAIMED, True)


def new(model: Any) -> Any:
    """An empty dynamic cache for ``model``'s language model."""
    return DynamicCache(config=model.config.get_text_config())


def byte_size(cache: Any) -> int:
    """Bytes the cache's keys and values take (state layers, which pruning leaves as they are, apart)."""
    return sum(
        t.numel() * t.element_size() for layer in key_value_layers(cache) for t in (layer.keys, layer.values)
    )


class ShiftedLength:
    """``cache`` as seen by a layer that derives its tokens' places in the sequence from the cache's length
    (Llama 4's attention temperature reads ``get_seq_length(layer_idx)``): its length counts ``shift`` more
    tokens, the prompt's pruned ones, so that the places are the unpruned prompt's; everything else
    (``update``, the masks' sizes) is the cache's own."""

    def __init__(self, cache: Any, shift: int) -> None:
        self._cache = cache
        self._shift = shift

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        return self._cache.get_seq_length(layer_idx) + self._shift

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def with_cache(kwargs: dict, view: Callable[[Any], Any]) -> dict:
    """A layer call's keyword arguments with its cache (under whichever name it came) replaced by
    ``view(cache)``; unchanged where the call has none."""
    for name in CACHE_NAMES:
        if kwargs.get(name) is not None:
            return {**kwargs, name: view(kwargs[name])}
    return kwargs


def of_output(output: Any) -> Any:
    """The cache a model returned (``output.cache`` from 5.24, ``output.past_key_values`` before)."""
    name = cache_field(output)
    return None if name is None else output.get(name)
