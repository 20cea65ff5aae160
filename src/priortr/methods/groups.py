"""Merge groups: "this survivor's slot averages these tokens with these weights", turned into a Selection.

Merging methods (VisionZip, PruMerge, SparseVLM, PriorTR+Merging) describe each survivor as a
:class:`Group`; :func:`merge_rows` and :func:`stack_merges` turn one image's groups into kept indices
and merge rows (``Selection.merge``). A merged representative takes the slot of one of its members,
whose position and cache entries the engine keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from priortr.methods.selection import Selection


@dataclass(frozen=True)
class Group:
    """One survivor: the slot it occupies and the tokens whose hidden states it averages.

    Attributes:
        slot: index of the visual token whose position and cache entries the survivor keeps; must be
            one of ``members``.
        members: [M] int64 distinct indices of the merged tokens (a plainly kept token: ``[slot]``).
        weights: [M] non-negative weights, not all zero; normalised to sum to 1 by :func:`merge_rows`.
    """

    slot: int
    members: torch.Tensor
    weights: torch.Tensor


def plain_groups(indices: torch.Tensor) -> list[Group]:
    """Groups that keep each of ``indices`` [K] with its own hidden state (one-hot merge rows)."""
    one = torch.ones(1, dtype=torch.float32, device=indices.device)
    return [Group(int(i), indices[j : j + 1], one) for j, i in enumerate(indices.tolist())]


def uniform_group(members: torch.Tensor, slot: int) -> Group:
    """A group averaging ``members`` [M] with equal weights, placed at ``slot``."""
    weights = torch.ones(members.shape[0], dtype=torch.float32, device=members.device)
    return Group(slot, members, weights)


def merge_rows(groups: list[Group], n_visual: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept slots [K] (ascending) and merge rows [K, N] (each summing to 1) for one image's groups."""
    groups = sorted(groups, key=lambda group: group.slot)
    slots = [group.slot for group in groups]
    if len(set(slots)) != len(slots):
        raise ValueError(f"two merge groups share a slot: {slots}")
    device = groups[0].members.device
    merge = torch.zeros(len(groups), n_visual, dtype=torch.float32, device=device)  # [K, N]
    for row, group in enumerate(groups):
        if group.slot not in group.members.tolist():
            raise ValueError(f"merge group slot {group.slot} is not one of its members")
        weights = group.weights.float()
        merge[row].index_add_(0, group.members, weights / weights.sum())
    return torch.tensor(slots, dtype=torch.int64, device=device), merge


def stack_merges(per_image: list[list[Group]], n_visual: int) -> Selection:
    """Stack each image's groups into a Selection; ``merge`` is None when every group is a plain keep."""
    merges = [merge_rows(groups, n_visual) for groups in per_image]
    kept = torch.stack([slots for slots, _ in merges])  # [B, K]
    if all(group.members.numel() == 1 for groups in per_image for group in groups):
        return Selection(indices=kept)
    return Selection(indices=kept, merge=torch.stack([merge for _, merge in merges]))  # [B, K, N]
