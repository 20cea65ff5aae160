"""The cut: apply one stage's decisions to the hidden states, the sequence map and the KV cache.

Kept visual tokens and every text token stay, in order, with their original positions (paper
Algorithm 1, Phase 3); the KV cache of the layers already run is compacted the same way. Every row's
new length is known on the host (text tokens plus the budgets of its pools), so the kept columns are
found with fixed-size tensor work, never by reading which ones survived. Rows left shorter than the
longest keep some pruned tokens as fillers (ragged batches), masked from every query later on. The cut
edits none of its inputs but the cache: it returns the new hidden states, pools and sequence map.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from priortr import compat
from priortr.engine.evidence import PoolGroup
from priortr.engine.pools import Pool
from priortr.engine.state import StageState
from priortr.methods.scoring import Evidence
from priortr.methods.selection import Selection
from priortr.tensors.gathers import gather_sequence


@dataclass(frozen=True)
class Decision:
    """A selector's ``selection`` for ``group``, with the hidden states it saw (for merges); a merge
    in ``features`` space combines ``features`` and maps the result through ``project``. ``evidence``:
    the Q and P it ranked by (methods that read attention), for the report."""

    group: PoolGroup
    selection: Selection
    hidden: torch.Tensor
    features: torch.Tensor | None = None
    project: Callable[[torch.Tensor], torch.Tensor] | None = None
    evidence: Evidence | None = None

    @property
    def changes(self) -> bool:
        """Whether the decision drops or merges any of the group's tokens."""
        return self.selection.indices.shape[1] < self.group.size or self.selection.merge is not None


def cut(
    state: StageState,
    layer: int,
    text_tokens: list[int],
    decisions: tuple[Decision, ...],
    hidden: torch.Tensor,
    cache: Any,
) -> tuple[torch.Tensor, StageState]:
    """Keep what the decisions of the stage scored at ``layer`` keep (and every token of the pools it does
    not rank), drop the other visual tokens from ``hidden`` [B, S', D] and from the caches of layers
    ``0 .. layer``, which ran; rows hold ``text_tokens`` text tokens each.

    Returns the new hidden states [B, S'', D] and the new state: each decision's pools narrowed to their
    survivors, the sequence map of the kept columns.
    """
    sequence = state.sequence
    unranked = [pool for pool in state.pools if layer not in pool.layers]
    keep = ~sequence.visual  # [B, S'] text and padding always stay
    lengths = list(text_tokens)
    for decision in decisions:
        group = decision.group
        kept = decision.selection.indices.to(group.columns.device)  # [G, k]
        keep[group.rows[:, None], group.columns.gather(1, kept)] = True
        for pool in group.pools:
            lengths[pool.row] += kept.shape[1]
    for pool in unranked:
        keep[pool.row, sequence.columns(pool.row_index, pool.positions[None])[0]] = True
        lengths[pool.row] += pool.size
    width = max(lengths)
    filler = None
    order = torch.where(keep, 0, 2)  # 0: kept, 2: dropped
    if any(length < width for length in lengths):
        missing = width - keep.sum(dim=1)  # [B] every row keeps its text and ``lengths`` tokens in all
        dropped = ~keep
        filler = dropped & (dropped.long().cumsum(dim=1) <= missing[:, None])
        # 0: left padding, 1: filler, 2: kept token, 3: dropped
        order = torch.where(filler, 1, torch.where(keep, 2 * sequence.valid.long(), 3))
    # Fillers go right after the row's left padding, before every kept token: a layer that carries a state
    # along the sequence (linear attention) starts from nothing over them, as over the padding.
    index = torch.argsort(order, dim=1, stable=True)[:, :width]  # [B, S'']
    out = gather_sequence(hidden, index)
    merges = [decision for decision in decisions if decision.selection.merge is not None]
    if merges:
        columns = torch.arange(width, device=index.device).expand_as(index)
        slot = torch.zeros_like(order).scatter(1, index, columns)  # [B, S'] new column of every kept column
        for decision in merges:
            _merge(out, slot, decision)
    if cache is not None and layer + 1 > 0:
        compat.cache.compact(cache, index, sequence.width, layer + 1)
    pools = list(state.pools)
    for decision in decisions:
        for i, pool in zip(decision.group.indices, _narrowed(decision), strict=True):
            pools[i] = pool
    kept = sequence.after_cut(index, None if filler is None else filler.gather(1, index))
    return out, StageState(tuple(pools), kept)


def _merge(out: torch.Tensor, slot: torch.Tensor, decision: Decision) -> None:
    """Write the merged hidden states of the group's survivors into their new columns of ``out``."""
    group, selection = decision.group, decision.selection
    if selection.merge_space == "features":
        merged = _merge_features(decision)
    else:
        dtype = torch.promote_types(out.dtype, torch.float32)
        merged = torch.matmul(selection.merge.to(out.device, dtype), decision.hidden.to(out.device, dtype))
    kept_columns = group.columns.gather(1, selection.indices.to(group.columns.device))  # [G, k]
    rows = group.rows[:, None]
    out[rows, slot[rows, kept_columns]] = merged.to(out.dtype)


def _merge_features(decision: Decision) -> torch.Tensor:
    """The survivors' embeddings when the merge combines the features before the projector."""
    features, project = decision.features, decision.project
    if features is None or project is None:
        raise ValueError(
            "a merge in 'features' space needs the vision tower's features and the projector; declare "
            "'features' among the method's needs"
        )
    dtype = torch.promote_types(features.dtype, torch.float32)
    weights = decision.selection.merge.to(features.device, dtype)
    merged = torch.matmul(weights, features.to(dtype))  # [G, k, C]
    return project(merged.to(features.dtype))  # [G, k, D]


def _narrowed(decision: Decision) -> list[Pool]:
    """The group's pools narrowed to the tokens that survived."""
    group, kept = decision.group, decision.selection.indices.to(decision.group.positions.device)
    positions, item_of, offset = (
        values.gather(1, kept) for values in (group.positions, group.item_of, group.offset)
    )
    return [pool.after_cut(positions[g], item_of[g], offset[g]) for g, pool in enumerate(group.pools)]
