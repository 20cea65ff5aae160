"""What the stages of a prefill have left so far: the state one stage takes and the next one gets.

The plan (``priortr.engine.plan.PrefillPlan``) is fixed before the first stage; a stage reads it and a
``StageState`` and returns a new ``StageState`` (``priortr.engine.stage.run_stage``), so nothing a stage
reads changes under it.
"""

from __future__ import annotations

from dataclasses import dataclass

from priortr.engine.plan import PrefillPlan
from priortr.engine.pools import Pool
from priortr.engine.sequence import SequenceMap


@dataclass(frozen=True)
class StageState:
    """The pools' surviving tokens (aligned with the plan's pools) and the map of the current sequence."""

    pools: tuple[Pool, ...]
    sequence: SequenceMap

    @classmethod
    def of_prompt(cls, plan: PrefillPlan) -> StageState:
        """The state before the first stage: the plan's pools, the whole prompt."""
        return cls(plan.pools, SequenceMap.of_prompt(plan.visual, plan.valid))
