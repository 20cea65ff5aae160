"""vLLM's encoder-cache accounting, with a pruned image counted at what it stores: N embeddings.

vLLM's encoder cache manager counts an image at its placeholders' embeddings (``get_num_embeds``, K
for a pruned image) when it checks for room, allocates and frees (``vllm/v1/core/encoder_cache_manager.py
:149-244,260-299`` in vLLM 0.33), while a pruned image's encoder output is its N rows, all of which
the plug-in's model keeps (``models.py``, ``embed_multimodal``). ``PrunedEncoderCache`` counts N:
room for N is checked (with the N - K of the request's images scheduled before it in the same call),
N slots are taken, and N come back when the entry is freed or evicted. vLLM's scheduler also compares
an entry's count with the placeholders' before reusing it and refuses a request on a mismatch
(``vllm/v1/core/sched/scheduler.py:2135-2147``): to that check the entry still reports K.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from priortr.integrations.vllm.request_records import image_record


def uncounted(request: Any, inputs: Any = None) -> int:
    """The embeddings vLLM does not count for a request's pruned images (N - K each): of the images
    ``inputs`` (indices into ``request.mm_features``), or of all of them (None)."""
    features = request.mm_features
    chosen = range(len(features)) if inputs is None else inputs
    return sum(_extra(features[i]) for i in chosen)


def _extra(feature: Any) -> int:
    """N - K of a pruned image (its processor recorded N), 0 for any other item."""
    record = image_record(feature)
    return 0 if record is None else record.encoded - feature.mm_position.get_num_embeds()


class PrunedEncoderCache(EncoderCacheManager):
    """vLLM's encoder cache manager counting a pruned image's N (module docstring), plus, for a method
    pruning before the language model, the slots its tower evidence takes beside them (``evidence``:
    N -> slots, ``vision_evidence.evidence_slots``; issue 57)."""

    def __init__(self, cache_size: int, evidence: Callable[[int], int] | None = None) -> None:
        super().__init__(cache_size)
        self.evidence = evidence
        self.placeholders_by_hash: dict[str, int] = {}
        """K of each cached pruned image, what the scheduler's reuse check compares."""
        self.checked: dict[str, int] = {}
        """The N - K each image was checked for by ``can_allocate``, which ``allocate`` takes."""

    def reset(self) -> None:
        super().reset()
        self.placeholders_by_hash.clear()
        self.checked.clear()

    def can_allocate(
        self, request: Any, input_id: int, encoder_compute_budget: int, num_embeds_to_schedule: int
    ) -> bool:
        """Room for the image's N and the N - K of the request's pruned images scheduled before it in
        this call (those not cached yet; vLLM's count of them, ``num_embeds_to_schedule``, holds K).
        Images that the whole cache could never hold at N are counted at K, as vLLM counts them, so
        that their request is still served rather than waiting for room that never comes."""
        features = request.mm_features
        before = sum(
            self._stored(features[i]) for i in range(input_id) if features[i].identifier not in self.cached
        )
        own = self._stored(features[input_id])
        wanted = request.get_num_encoder_embeds(input_id) + num_embeds_to_schedule + before + own
        if wanted > self.cache_size:
            before = own = 0
        self.checked[features[input_id].identifier] = own
        room = super().can_allocate(
            request, input_id, encoder_compute_budget, num_embeds_to_schedule + before + own
        )
        for identifier in self.freed:  # evicted to make room: forget their K
            self.placeholders_by_hash.pop(identifier, None)
        return room

    def _stored(self, feature: Any) -> int:
        """What vLLM does not count of an item's cache entry: N - K of a pruned image, and its evidence."""
        record = image_record(feature)
        if record is None or self.evidence is None:
            return _extra(feature)
        return _extra(feature) + self.evidence(record.encoded)

    def allocate(self, request: Any, input_id: int) -> None:
        """vLLM's allocation, then the N - K more slots ``can_allocate`` found for a pruned image (never
        more than are free), its entry counted at what it took."""
        super().allocate(request, input_id)
        identifier = request.mm_features[input_id].identifier
        extra = min(self.checked.pop(identifier, 0), self.num_free_slots, self.num_freeable_slots)
        if extra > 0:
            self.placeholders_by_hash[identifier] = self.num_embeds_by_hash[identifier]
            self.num_embeds_by_hash[identifier] += extra
            self.num_free_slots -= extra
            self.num_freeable_slots -= extra

    def get_freed_mm_hashes(self) -> list[str]:
        """vLLM's call once a step's scheduling is done (every allocation made): what was checked and
        not allocated is forgotten with it."""
        self.checked.clear()
        return super().get_freed_mm_hashes()

    def get_cached_num_encoder_embeds(self, request: Any, input_id: int) -> int | None:
        """The cached entry's count as its placeholders give it (K for a pruned image)."""
        identifier = request.mm_features[input_id].identifier
        if identifier not in self.num_embeds_by_hash:
            return None
        return self.placeholders_by_hash.get(identifier, self.num_embeds_by_hash[identifier])
