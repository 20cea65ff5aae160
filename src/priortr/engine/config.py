"""What to prune and how (``PruningConfig``), validated by ``priortr.apply`` before any forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from priortr.engine.pools import split_count
from priortr.methods import MethodInfo
from priortr.methods.registry import DEFAULT_LAYER as DEFAULT_LAYER
from priortr.methods.scoring import resolve_budget

POSTERIOR_ROWS = ("after_separator", "from_separator", "last")
HEAD_AGGREGATIONS = ("mean", "max")
BEFORE_LLM = -1
"""The stage layer of methods that prune the language model's input embeddings (``where='vision'``)."""


class PruningSkippedWarning(UserWarning):
    """A forward pass ran unpruned because its prompt has nothing to prune."""


@dataclass(frozen=True)
class PruningConfig:
    """What to prune and how; validated by ``priortr.apply``.

    ``layer`` is the 0-indexed decoder layer whose attention is scored by a one-layer method; layers
    ``layer+1 ..`` run on the kept tokens (the authors' code calls this "prune layer layer+1").
    ``stages`` replaces the method's schedule by explicit (scored layer, budget) pairs, the budgets
    counting or taking a ratio of the image's visual tokens. ``options`` are the selector's knobs.
    ``posterior_rows`` chooses the rows averaged into P: every prompt token after the separator
    (default), the separator too (as the authors' code does), or the last prompt token only.
    ``separator_offset`` moves the prior's slot that many tokens after the first post-image token
    (the paper's null-token ablation). ``multi_image`` says how the items of a row share the budget
    (``priortr.engine.pools``). ``strict`` raises instead of warning when a prompt has nothing to prune, and
    turns on the checks that read tensor values (they block the host on a GPU, so they are off by
    default: ``priortr.methods.value_checks``).
    """

    method: MethodInfo
    budget: int | float
    layer: int
    stages: tuple[tuple[int, int | float], ...] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    heads: str = "mean"
    posterior_rows: str = "after_separator"
    separator_offset: int = 0
    multi_image: str = "per_image"
    strict: bool = False
    seed: int = 0

    def plan(
        self, n_visual: int, n_layers: int, part: tuple[int, int] | None = None
    ) -> list[tuple[int, int]]:
        """The (layer, tokens kept after it) stages for a pool of ``n_visual`` tokens.

        ``part`` = (the row's visual tokens before this pool, all of them) splits a count budget over
        the pools of a row in proportion to their sizes (``pools.split_count``); ratios need no split.
        """

        def count(budget: int | float) -> int:
            if part is not None and isinstance(budget, int):
                budget = split_count(budget, part[0], n_visual, part[1])
            return resolve_budget(budget, n_visual)

        if self.stages is not None:
            return [(layer, count(budget)) for layer, budget in self.stages]
        kept = count(self.budget)
        if self.method.schedule is not None:
            return self.method.schedule(kept, n_visual, self.layer, n_layers)
        return [(BEFORE_LLM if self.method.where == "vision" else self.layer, kept)]
