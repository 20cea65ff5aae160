"""The pruning engine: the only code that touches hidden states, masks, positions and the KV cache.

It attaches PyTorch module hooks to a stock transformers model (no copied modeling code). Its parts,
in the order a prefill meets them:

* ``hooks``: the wiring. One permanent pre-hook on the multimodal model; per-layer hooks are armed for
  a pruned prefill only, so decode steps run none.
* ``plan``: the prefill's plan, made on the host from one copy of the prompt: images, pools, budgets,
  the attention rows to recompute.
* ``prefill``: the stages, between decoder layers; each reads gather evidence -> select -> cut.
* ``evidence``: what a selector sees (``StageInputs``): recomputed attention rows (Q, P, last row),
  hidden states, the vision tower's [CLS] attention, keys and features (``VISION_NEEDS``).
* ``cut``: hidden states, sequence map and KV cache narrowed to the kept tokens; ``sequence``: the map
  between prompt positions and current columns.
* ``ledger``: what later calls (decode steps, chat turns) need to continue a pruned cache.
* ``report``: ``handle.last`` (``PruneResult``), assembled when read.
"""

from priortr.engine.config import (
    BEFORE_LLM,
    DEFAULT_LAYER,
    HEAD_AGGREGATIONS,
    POSTERIOR_ROWS,
    PruningConfig,
    PruningSkippedWarning,
)
from priortr.engine.evidence import VISION_NEEDS
from priortr.engine.hooks import PruningEngine
from priortr.engine.report import PruneResult, StageResult

__all__ = [
    "BEFORE_LLM",
    "DEFAULT_LAYER",
    "HEAD_AGGREGATIONS",
    "POSTERIOR_ROWS",
    "VISION_NEEDS",
    "PruneResult",
    "PruningConfig",
    "PruningEngine",
    "PruningSkippedWarning",
    "StageResult",
]
