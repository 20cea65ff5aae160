"""Everything that depends on how a transformers release represents caches, masks and layer outputs.

Supported: transformers 5.x (>= 5.17). Decoder layers return a tensor (a tuple in 4.x); caches are a
list of per-layer objects with ``keys``/``values`` tensors [B, H_kv, S, d]; the mask each layer sees
is ``None`` (implicit causal), a 2D padding mask (FlashAttention), a 4D mask, or a flex BlockMask.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer

from priortr.surgery import explicit_causal_mask, gather_attention_mask, hide_key_columns

PRUNABLE_CACHE_LAYERS = (DynamicLayer, StaticLayer)


def cache_length(cache: Any) -> int | torch.Tensor:
    """Tokens in the cache: an int, or for a static cache a device tensor (reading it blocks the host)."""
    return cache.get_seq_length()


def host_cache_length(cache: Any) -> int | None:
    """Tokens in the cache when the host knows them without reading the device; None for static caches."""
    length = cache.get_seq_length()
    return length if isinstance(length, int) else None


def cache_layers(cache: Any) -> list:
    return list(cache.layers)


def first_cache_layer(cache: Any) -> Any:
    """Layer 0 of the cache: every forward pass updates it first. None while a lazy cache has none."""
    return cache.layers[0] if cache.layers else None


def is_static_cache(cache: Any) -> bool:
    """Whether the cache preallocates its slots (keys span ``max_cache_len`` in every layer call)."""
    return cache is not None and any(isinstance(layer, StaticLayer) for layer in cache_layers(cache))


def check_prunable_cache(cache: Any, layer: int) -> None:
    """Refuse caches whose layers cannot be compacted (sliding windows, quantised or offloaded caches)."""
    for index, cache_layer in enumerate(cache_layers(cache)[: layer + 1]):
        if type(cache_layer) not in PRUNABLE_CACHE_LAYERS:
            raise ValueError(
                f"cache layer {index} is a {type(cache_layer).__name__}; priortr can prune only "
                "DynamicCache and StaticCache layers (use cache_implementation='dynamic' or 'static')"
            )


def padding_mask(attention_mask: Any, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """[B, S] bool, False on padding, from whatever mask the multimodal model was called with."""
    if isinstance(attention_mask, dict):
        attention_mask = attention_mask.get("full_attention")
    if attention_mask is None:
        return torch.ones(batch, seq, dtype=torch.bool, device=device)
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"unsupported attention mask type {type(attention_mask).__name__} for a pruned prefill"
        )
    if attention_mask.ndim == 2:
        if attention_mask.shape[1] != seq:
            raise ValueError(
                f"the attention mask covers {attention_mask.shape[1]} tokens but the prompt has {seq}; "
                "pruning happens on a prefill from an empty cache"
            )
        return attention_mask.bool().to(device)
    if attention_mask.ndim == 4:
        last_row = attention_mask[:, 0, -1, :seq]  # the last query sees every non-padding key
        valid = last_row if last_row.dtype == torch.bool else last_row == 0
        return valid.expand(batch, seq).to(device)
    raise ValueError(f"unsupported attention mask of shape {tuple(attention_mask.shape)}")


def gather_layer_mask(
    mask: Any,
    index: torch.Tensor,
    seq: int,
    static_slots: bool,
    hidden: torch.Tensor | None = None,
    implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
) -> Any:
    """The per-layer mask for layers after the prune (see ``surgery.gather_attention_mask``), with the
    key columns ``hidden`` [B, S'] masked (fillers of ragged rows; None when there are none);
    ``implementation`` and ``dtype`` say which kind of mask to build where the model passed none."""
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise ValueError(
            f"priortr cannot prune with a {type(mask).__name__} attention mask (flex attention); "
            "load the model with attn_implementation='sdpa', 'eager' or 'flash_attention_2'"
        )
    mask = gather_attention_mask(mask, index, seq, static_slots)
    if hidden is None:
        return mask
    if mask is None:
        return explicit_causal_mask(hidden, implementation, dtype)
    return hide_key_columns(mask, hidden)


def hide_cached_columns(mask: Any, hidden: torch.Tensor) -> Any:
    """Mask the cache slots ``hidden`` [B, S_cached] (the first slots of the cache) in whatever mask a
    continuation gets: a 2D padding mask after the dropped columns are removed, a 4D mask over the
    cache's slots, or the dict of prepared masks that ``generate()`` passes with a static cache."""
    if isinstance(mask, dict):
        return {kind: hide_cached_columns(value, hidden) for kind, value in mask.items()}
    if isinstance(mask, torch.Tensor):
        return hide_key_columns(mask, hidden)
    if mask is None:
        return None
    raise ValueError(f"unsupported attention mask type {type(mask).__name__} on a pruned cache")


def first_query_rows(mask: Any, rows: int) -> Any:
    """The first ``rows`` query rows of a prepared 4D mask (or of generate()'s dict of them); a 2D
    padding mask or None has no query rows and is returned as is."""
    if isinstance(mask, dict):
        return {kind: first_query_rows(value, rows) for kind, value in mask.items()}
    if isinstance(mask, torch.Tensor) and mask.ndim == 4:
        return mask[:, :, :rows]
    return mask


RAW_PIXEL_ARGUMENTS = ("pixel_values", "pixel_values_images", "pixel_values_videos")
"""Model arguments that carry raw images or video (``pixel_values_images``: Video-LLaVA before 5.23)."""


def has_raw_pixels(call: dict) -> bool:
    """Whether a model call brings raw images or video, which the vision tower encodes inside it."""
    return any(call.get(key) is not None for key in RAW_PIXEL_ARGUMENTS)


def has_visual_inputs(call: dict) -> bool:
    """Whether a model call brings images (raw, or pre-encoded by ``generate()``)."""
    encoded = call.get("mm_encoder_outputs") or {}
    return has_raw_pixels(call) or any(value is not None for value in encoded.values())


def rename_image_argument(model: Any, inputs: dict) -> dict:
    """``inputs`` with ``pixel_values`` renamed ``pixel_values_images`` for models whose forward still
    calls it that (Video-LLaVA before transformers 5.23)."""
    parameters = inspect.signature(model.forward).parameters
    if "pixel_values" in inputs and "pixel_values" not in parameters and "pixel_values_images" in parameters:
        inputs = dict(inputs)
        inputs["pixel_values_images"] = inputs.pop("pixel_values")
    return inputs
