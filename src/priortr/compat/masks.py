"""Attention masks as the layers of a pruned prefill and the calls after it must see them.

A decoder layer gets whatever mask transformers built for the model's attention implementation:
``None`` (SDPA's implicit causal mask, nothing padded), a 2D padding mask (FlashAttention), a 4D mask
(boolean for SDPA, additive for eager), or a flex ``BlockMask``. Once visual tokens are dropped the
mask must follow: its rows and key columns are gathered to the kept tokens, and keys that stay only to
give ragged rows one length are hidden. Where the model passed ``None`` and such keys must be hidden,
an explicit mask is built of the kind transformers builds for the implementation (``EXPLICIT``, keyed
by transformers' own mask builder for it). Flex attention's ``BlockMask`` cannot be gathered and is
refused when pruning is attached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import masking_utils

from priortr.compat import layers
from priortr.tensors.gathers import gather_sequence


def padding_mask(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 2D padding mask: FlashAttention's, and the only mask of a layer without attention over the
    sequence (linear attention zeroes masked inputs, ``create_recurrent_attention_mask``)."""
    return (~hidden).long()


def _boolean_mask(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    seq = hidden.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=hidden.device).tril()
    return causal[None, None] & ~hidden[:, None, None, :]  # [B, 1, S, S]


def _additive_mask(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    allowed = _boolean_mask(hidden, dtype)
    return torch.zeros(allowed.shape, dtype=dtype, device=hidden.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


ExplicitMask = Callable[[torch.Tensor, torch.dtype], torch.Tensor]
EXPLICIT: dict[Callable, ExplicitMask] = {
    masking_utils.sdpa_mask: _boolean_mask,
    masking_utils.eager_mask: _additive_mask,
    masking_utils.flash_attention_mask: padding_mask,
}
"""transformers' mask builder for an implementation -> the mask priortr builds for it, given the keys to
hide [B, S] and a float dtype: a boolean 4D mask (SDPA), an additive one (eager), 2D padding (flash)."""


def explicit_mask_builder(implementation: str) -> ExplicitMask:
    """The explicit mask for ``implementation`` (``config._attn_implementation``), through the mask
    builder transformers registered for it; refuses implementations whose masks priortr cannot gather."""
    builder = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.get(implementation)
    if builder not in EXPLICIT:
        raise ValueError(
            f"priortr cannot prune with attn_implementation={implementation!r} (its masks cannot be gathered "
            "to the kept tokens); load the model with attn_implementation='sdpa', 'eager' or "
            "'flash_attention_2'"
        )
    return EXPLICIT[builder]


def _masked_value(mask: torch.Tensor) -> bool | float:
    return False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min


def padding(attention_mask: Any, batch: int, seq: int, device: torch.device) -> torch.Tensor:
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
        # Every real key is seen by its own query, padding by none; the last query alone would miss the
        # keys outside a sliding window or chunk.
        rows = attention_mask[:, 0, :, :seq]
        allowed = rows if rows.dtype == torch.bool else rows == 0
        return allowed.any(dim=1).expand(batch, seq).to(device)
    raise ValueError(f"unsupported attention mask of shape {tuple(attention_mask.shape)}")


def gather(mask: torch.Tensor | None, index: torch.Tensor, seq_len: int, key_length: int) -> Any:
    """The mask a decoder layer should see once only ``index`` [B, S'] positions are left.

    ``None`` (implicit causal, SDPA without padding) stays ``None``: kept tokens are in order, so the
    short sequence is still causal. A 2D padding mask (FlashAttention; linear attention) keeps the
    indexed columns. A 4D mask [B, 1, S, S_kv] keeps the indexed rows and columns, so a local window or a
    bidirectional image block it encodes stays in the prompt's own positions. Where the layer attends
    over more than the S' kept tokens (``key_length``: a static cache's preallocated slots), the kept
    columns come first, like the compacted cache entries, and every other column is masked.
    """
    if mask is None:
        return None
    if mask.ndim == 2:
        return gather_sequence(mask, index, dim=1)
    if mask.ndim != 4:
        raise ValueError(f"unsupported attention mask of shape {tuple(mask.shape)}; expected None, 2D or 4D")
    rows = gather_sequence(mask, index, dim=2)  # [B, 1, S', S_kv]
    kept_cols = gather_sequence(rows[..., :seq_len], index, dim=3)  # [B, 1, S', S']
    if key_length == index.shape[1]:
        return kept_cols
    out = kept_cols.new_full((*kept_cols.shape[:3], key_length), _masked_value(mask))
    out[..., : index.shape[1]] = kept_cols
    return out


def hide_key_columns(mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``mask`` (2D padding or 4D) with its first key columns masked where ``hidden`` [B, S'] is True.

    Rows of a batch whose visual tokens were pruned to different counts keep some pruned tokens so
    that every row has the same length; those keys (the first S' columns of a gathered layer mask, or
    the cached prompt's columns of a later call's mask) must be invisible to every query.
    """
    blocked = torch.zeros(mask.shape[0], mask.shape[-1], dtype=torch.bool, device=mask.device)
    blocked[:, : hidden.shape[1]] = hidden.to(mask.device)
    if mask.ndim == 2:
        return mask.masked_fill(blocked, 0)
    return mask.masked_fill(blocked[:, None, None, :], _masked_value(mask))


def for_kept_layer(
    mask: Any,
    index: torch.Tensor,
    seq: int,
    key_length: int,
    hidden: torch.Tensor | None,
    explicit: ExplicitMask,
    dtype: torch.dtype,
) -> Any:
    """The mask of a layer after the prune (``gather``, to ``key_length`` keys), with the key columns
    ``hidden`` [B, S'] masked (fillers of ragged rows; None when there are none); ``explicit`` builds one
    where the model passed none, in ``dtype`` where it is additive."""
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise ValueError(
            f"priortr cannot prune with a {type(mask).__name__} attention mask (flex attention); "
            "load the model with attn_implementation='sdpa', 'eager' or 'flash_attention_2'"
        )
    mask = gather(mask, index, seq, key_length)
    if hidden is None:
        return mask
    if mask is None:
        return explicit(hidden, dtype)
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


def implementation(model: Any) -> str:
    """The attention implementation the language model runs (``config._attn_implementation``)."""
    return getattr(model.config.get_text_config(), "_attn_implementation", None) or "sdpa"


@dataclass(frozen=True)
class WindowPositions:
    """The text positions of a pruned cache's slots, for local windows: the cached prompt tokens'
    ``kept`` [B, S'] (``kept_length`` S' of them), then one per later token from ``next`` [B] on."""

    kept: torch.Tensor
    next: torch.Tensor
    kept_length: int

    def of_slots(self, batch: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Text positions of cache slots ``slot`` of rows ``batch`` (mask-function indices, broadcast)."""
        prompt = self.kept[batch, slot.clamp(max=self.kept_length - 1)]
        return torch.where(slot < self.kept_length, prompt, self.next[batch] + slot - self.kept_length)


def windowed(
    text_config: Any,
    cache: Any,
    padding: torch.Tensor | None,
    positions: WindowPositions,
    new: int,
    dtype: torch.dtype,
    prepared: Any = None,
) -> Any:
    """The masks of a call that continues a pruned cache in a model with local attention layers.

    transformers builds a local layer's mask over cache slots, and after pruning a slot is no longer a
    position: the window must count the tokens' own positions. Each local layer type gets transformers'
    ``create_causal_mask`` over its own cache layer's slots, with ``padding`` [B, K] (the pruned cache's
    2D mask; None when no slot is masked) and its window over ``positions``; a global type keeps the mask
    ``generate()`` ``prepared`` for it (static caches, fillers already hidden) or gets the causal one. A
    model with one layer type gets that mask, one with several the dict by type its text model takes.
    """
    kinds = layers.types(text_config)
    local = layers.windows(text_config)
    kept = positions.kept
    stub = torch.empty((kept.shape[0], new, 0), dtype=dtype, device=kept.device)  # shape, dtype, device
    masks = {}
    for kind in dict.fromkeys(kinds):
        first = kinds.index(kind)
        window = local[first]
        if window is None and kind != "full_attention":
            raise ValueError(
                f"priortr cannot continue a pruned cache of a model with {kind} and local layers"
            )
        if window is None and isinstance(prepared, dict) and kind in prepared:
            masks[kind] = prepared[kind]
            continue
        visible = None
        if window is not None:

            def visible(batch, head, query, slot, window=window):
                return window.visible(positions.of_slots(batch, query), positions.of_slots(batch, slot))

        masks[kind] = masking_utils.create_causal_mask(
            text_config, stub, padding, cache, None, and_mask_function=visible, layer_idx=first
        )
    return masks if getattr(text_config, "layer_types", None) else masks[kinds[0]]
