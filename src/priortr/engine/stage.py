"""One stage, values in and values out: the core that ``priortr.apply``'s prefill and the vLLM plug-in's
step share.

``run_stage(layer, sources, hidden, cache)`` runs the stage scored at ``layer`` (-1: before the language
model): gather evidence -> select -> cut (paper Algorithm 1, Phases 2-3). It reads the frozen plan and
the state the stages before it left (both in ``sources``), edits neither, and returns the stage's
decisions and the new state (``StageOutcome``). Every check runs on every front end: the selection's
shape against its group, and the checks that read tensor values when the configuration is ``strict``.
All of one stage's work (evidence, decisions, cut, cache compaction) is this one call, so a caller can
bracket a stage from outside (timing marks, profiling) whatever order its hooks run in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from priortr.engine.config import PruningConfig
from priortr.engine.cut import Decision, cut
from priortr.engine.evidence import PoolGroup, Sources, gather
from priortr.engine.state import StageState
from priortr.methods.selection import StageInputs
from priortr.methods.value_checks import value_checks_enabled
from priortr.tensors.gathers import stack_views


@dataclass(frozen=True)
class StageOutcome:
    """What the stage scored at ``layer`` decided (one ``Decision`` per group it ranked), the state it
    leaves (``state``) and the hidden states [B, S'', D] the next layer runs on."""

    layer: int
    decisions: tuple[Decision, ...]
    state: StageState
    hidden: torch.Tensor

    @property
    def merged(self) -> bool:
        """Whether any survivor carries merged hidden states."""
        return any(decision.selection.merge is not None for decision in self.decisions)


@torch.no_grad()
def run_stage(
    layer: int,
    sources: Sources,
    hidden: torch.Tensor,
    cache: Any = None,
    project: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> StageOutcome:
    """The stage scored at ``layer`` on ``hidden`` [B, S', D] (the input of layer ``layer + 1``), whose
    evidence ``sources`` give: every group's selection, then one cut of ``hidden``, the sequence and the
    caches of layers ``0 .. layer`` in ``cache`` (None: the caller keeps its own). ``project`` maps vision
    features to embeddings, for merges in features space."""
    config, state = sources.config, sources.state
    needs = config.method.needs
    with value_checks_enabled(config.strict):
        decisions = tuple(
            decide(
                group,
                StageInputs(budget=group.budget, seed=config.seed, **gather(needs, sources, group)),
                config,
                project,
            )
            for group in groups(state, layer, "input_embeddings" in needs)
        )
        if any(decision.changes for decision in decisions):
            hidden, state = cut(state, layer, sources.plan.text_tokens, decisions, hidden, cache)
    return StageOutcome(layer, decisions, state, hidden)


def groups(state: StageState, layer: int, by_input_size: bool = False) -> list[PoolGroup]:
    """The pools that stage ``layer`` ranks, grouped by (size, budget), and by their size at the input
    too when ``by_input_size`` (methods that read every input token of an image)."""
    sequence = state.sequence
    by_key: dict[tuple[int, int, int], list[int]] = {}
    for index, pool in enumerate(state.pools):
        if layer in pool.layers:
            input_size = sum(item.size for item in pool.items) if by_input_size else 0
            budget = min(pool.kept_count(layer), pool.size)
            by_key.setdefault((pool.size, budget, input_size), []).append(index)
    out = []
    for (_, budget, _), indices in by_key.items():
        pools = [state.pools[i] for i in indices]
        rows = [pool.row for pool in pools]
        row_index = stack_views([pool.row_index for pool in pools]).flatten()  # [G]
        positions = stack_views([pool.positions for pool in pools])  # [G, n]
        out.append(
            PoolGroup(
                pools=pools,
                indices=indices,
                budget=budget,
                row_list=rows,
                rows=row_index,
                positions=positions,
                item_of=stack_views([pool.item_of for pool in pools]),
                offset=stack_views([pool.offset for pool in pools]),
                columns=sequence.columns(row_index, positions),
            )
        )
    return out


def decide(
    group: PoolGroup,
    inputs: StageInputs,
    config: PruningConfig,
    project: Callable[[torch.Tensor], torch.Tensor] | None,
) -> Decision:
    """The method's selection for ``group`` from its ``inputs``, checked against the group's size."""
    method = config.method
    selection = method.select(inputs, **dict(config.options))
    if selection.indices.shape[0] != len(group.pools) or selection.indices.shape[1] > group.size:
        raise ValueError(
            f"method {method.name!r} kept {tuple(selection.indices.shape)} visual tokens for "
            f"{len(group.pools)} images of {group.size} tokens"
        )
    return Decision(group, selection, inputs.hidden, inputs.vision_features, project, inputs.attention)
