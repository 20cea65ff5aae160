"""The cache ledger: what later calls need to continue a cache whose prompt was pruned.

A pruned cache holds S' of the prompt's S tokens, so the calls that follow the prefill (decode steps,
later chat turns) must see masks and positions that match the shorter cache: generate() counts
positions from the whole conversation and builds masks over it. The ledger is made at the end of the
pruned prefill (``ledger_for``) and written when the model returns from it (``write_ledger``), as an
attribute of the cache object itself, so it travels wherever the cache goes (``copy.deepcopy``,
pickling). A decode step reads it and adjusts the call with tensor work only: no host sync, nothing
that changes from step to step (so a compiled decode step does not recompile).

The stock model knows nothing of the ledger: continued without pruning attached (after
``handle.remove()``, or on another model) it would attend with positions off by the dropped tokens and
answer wrongly without a word. So the pruned cache also guards itself: its first layer becomes a guarded
layer (``compat.cache.guard``), whose ``update`` (called by every forward pass before anything is
written to the cache) refuses a call that no attached engine has claimed. Claiming is a Python flag set
by the engine's model pre-hook and cleared by that update: nothing is read from the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from priortr import compat
from priortr.adapters import FamilyAdapter
from priortr.engine.plan import PrefillPlan
from priortr.engine.sequence import SequenceMap

ATTRIBUTE = "_priortr_ledger"


@dataclass(frozen=True)
class CacheLedger:
    """How a pruned cache differs from the prompt it stands for (all fixed at the prefill).

    Attributes:
        prompt_length: S, the prompt's tokens.
        kept_length: S', the prompt's tokens in the cache.
        prompt_mask: [B, S'] long, the prompt's padding mask at the cached tokens, 0 at fillers: the
            first S' columns of every later 2D mask.
        filler: [B, S'] bool, True at cached fillers (ragged batches), or None.
        next_position: [B] the text position of the token after the prompt.
        kept_positions: [B, S'] the positions local attention windows count for the cached prompt tokens
            (not cache slots): text positions from each row's first real token (``PrefillPlan``).
        window_next: [B] the same count for the token after the prompt.
        masked: whether any cached prompt slot is masked (left padding or fillers).
    """

    prompt_length: int
    kept_length: int
    prompt_mask: torch.Tensor
    filler: torch.Tensor | None
    next_position: torch.Tensor
    kept_positions: torch.Tensor
    window_next: torch.Tensor
    masked: bool

    @property
    def dropped(self) -> int:
        return self.prompt_length - self.kept_length


def ledger_of(cache: Any) -> CacheLedger | None:
    """The ledger of a pruned ``cache``; None for a cache that was never pruned or was reset since (its
    first layer is no longer guarded)."""
    ledger = getattr(cache, ATTRIBUTE, None) if cache is not None else None
    if ledger is None or not compat.cache.is_guarded(cache):
        return None
    return ledger


def ledger_for(plan: PrefillPlan, sequence: SequenceMap) -> CacheLedger:
    """The ledger of a prefill planned by ``plan`` whose cache holds the columns of ``sequence``."""
    return CacheLedger(
        prompt_length=plan.seq,
        kept_length=sequence.width,
        prompt_mask=sequence.key_valid().long(),
        filler=sequence.filler,
        next_position=plan.next_position,
        kept_positions=plan.window_positions.gather(1, sequence.positions),
        window_next=plan.window_next,
        masked=plan.padded or sequence.filler is not None,
    )


def write_ledger(cache: Any, ledger: CacheLedger | None) -> None:
    """Attach ``ledger`` to ``cache`` and guard the cache (the model returned from the pruned prefill); None
    removes both (the cache was reset for a new prompt). The only place a ledger is written."""
    if ledger is None:
        if hasattr(cache, ATTRIBUTE):
            delattr(cache, ATTRIBUTE)
        compat.cache.unguard(compat.cache.first_layer(cache))
        return
    setattr(cache, ATTRIBUTE, ledger)
    compat.cache.guard(cache)


def continue_call(
    ledger: CacheLedger,
    call: compat.calls.ModelCall,
    adapter: FamilyAdapter,
    model: torch.nn.Module,
    check: bool,
) -> None:
    """Adjust ``call`` (the multimodal model's arguments, in place) to continue its pruned cache.

    A one-token call is a decode step: nothing is read back from the device. A longer call (a new chat
    turn) reads the cache's length once, to undo generate()'s slicing of the conversation by the
    physical (shorter) cache length; ``check`` (``strict=True``) also verifies a decode step's positions.
    """
    if call.has_visual_inputs:
        raise ValueError(
            "new images on a pruned cache are not supported: the cache was pruned at the first turn; "
            "start a new cache for a new image"
        )
    cache, new = call.cache, call.new_tokens
    cached = compat.cache.host_length(cache)  # None where reading it would block (static caches)
    mask = call.attention_mask
    host_checkable = cached is not None and isinstance(mask, torch.Tensor) and mask.ndim == 2
    if new > 1 or check or host_checkable:
        cached = int(compat.cache.length(cache)) if cached is None else cached
        new = _align(ledger, call, new, cached)
    text_positions = adapter.text_positions(model, call.position_ids)
    if text_positions is None:
        length = compat.cache.length(cache) if cached is None else cached
        steps = torch.arange(new, device=ledger.next_position.device)
        positions = ledger.next_position[:, None] + (length - ledger.kept_length) + steps
        call.set_position_ids(adapter.continuation_position_ids(model, positions))
    text_config = model.config.get_text_config()
    local = compat.layers.local_types(text_config)
    call.set_attention_mask(_mask(ledger, call.attention_mask, new, cache, cached, local))
    if local:
        padding = call.attention_mask
        if not (isinstance(padding, torch.Tensor) and padding.ndim == 2):
            padding = _padding(ledger, new, cache, cached) if ledger.masked else None
        positions = compat.masks.WindowPositions(
            ledger.kept_positions, ledger.window_next, ledger.kept_length
        )
        windowed = compat.masks.windowed(
            text_config, cache, padding, positions, new, model.dtype, call.attention_mask
        )
        call.set_attention_mask(windowed)


def _align(ledger: CacheLedger, call: compat.calls.ModelCall, new: int, cached: int) -> int:
    """Check that a call continues the cache; drop the inputs generate() sent although they are cached.

    generate() slices a conversation by the cache's length, which pruning shortened by ``dropped``
    tokens, so a new turn arrives with its first ``dropped`` tokens already in the cache.
    """
    logical = cached + ledger.dropped
    mask = call.attention_mask
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        past = mask.shape[1] - new
        sliced = past == cached and new > ledger.dropped > 0
        if past != logical and not sliced:
            raise ValueError(
                f"the attention mask covers {mask.shape[1]} tokens, but the pruned cache stands for "
                f"{logical} tokens plus {new} new ones; pass the mask of the whole conversation"
            )
    else:
        sliced = _sliced_by_positions(ledger, call.position_ids, new, cached)
    if not sliced:
        return new
    call.drop_leading(ledger.dropped)
    # A prepared mask (static caches) has a row per sent input, laid out from the cache's physical
    # length: the rows of the inputs that remain are its first ones.
    call.set_attention_mask(compat.masks.first_query_rows(mask, new - ledger.dropped))
    return new - ledger.dropped


def _sliced_by_positions(
    ledger: CacheLedger, position_ids: torch.Tensor | None, new: int, cached: int
) -> bool:
    """Without a 2D mask, the first text position says whether the inputs continue the cache."""
    if position_ids is None:
        return False
    text = position_ids[0] if position_ids.ndim == 3 else position_ids
    expected = ledger.next_position + (cached - ledger.kept_length)
    first = text[..., 0].expand_as(expected).to(expected.device)
    if bool((first == expected).all()):
        return False
    if new > ledger.dropped and bool((first == expected - ledger.dropped).all()):
        return True
    raise ValueError(
        "the inputs do not continue the pruned cache: expected text positions starting at "
        f"{expected.tolist()}, got {first.tolist()}"
    )


def _padding(ledger: CacheLedger, new: int, cache: Any, cached: int | None) -> torch.Tensor:
    """[B, K] the padding mask of the cache's tokens and the call's: the prompt's cached tokens as the
    ledger has them, every later token real; K covers the cache's slots (all of a static cache's)."""
    later = (cached if cached is not None else compat.cache.max_length(cache)) - ledger.kept_length + new
    return torch.cat(
        [ledger.prompt_mask, ledger.prompt_mask.new_ones(ledger.prompt_mask.shape[0], later)], dim=1
    )


def _mask(
    ledger: CacheLedger, mask: Any, new: int, cache: Any, cached: int | None, local: frozenset[str]
) -> Any:
    """The mask of a call on the pruned cache: a 2D mask loses the pruned prompt columns; prepared masks
    (4D, or generate()'s dict for static caches) get the cached fillers hidden. A prepared mask of a
    ``local`` layer type spans its window cache's slots, not the cached prompt's columns, and is not
    used: ``compat.masks.windowed`` builds the masks of local types from the ledger's positions."""
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        if mask.shape[1] < ledger.prompt_length + new:
            raise ValueError(
                f"the attention mask covers {mask.shape[1]} tokens, fewer than the pruned prompt's "
                f"{ledger.prompt_length} plus {new} new ones; pass the mask of the whole conversation"
            )
        return torch.cat([ledger.prompt_mask.to(mask.dtype), mask[:, ledger.prompt_length :]], dim=1)
    if ledger.filler is None:
        return mask
    if isinstance(mask, dict):
        mask = {kind: value for kind, value in mask.items() if kind not in local}
    elif local:
        return mask  # the model's one layer type is local: compat.masks.windowed builds its mask
    if mask is None:
        cached = int(compat.cache.length(cache)) if cached is None else cached
        tail = ledger.prompt_mask.new_ones(ledger.prompt_mask.shape[0], cached - ledger.kept_length + new)
        return torch.cat([ledger.prompt_mask, tail], dim=1)
    return compat.masks.hide_cached_columns(mask, ledger.filler)
