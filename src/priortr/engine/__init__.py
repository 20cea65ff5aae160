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
* ``result``: ``handle.last`` (``PruneResult``), assembled when read.

Its private parts sit beside them: ``attention`` (attention rows and RoPE recomputed from a layer's
projections), ``pools`` (the visual tokens ranked together), ``host`` (host/device copies that do not
stall the device). The public names below are imported on first use, so that the adapters and
``priortr.compat`` can import those parts without importing the engine's wiring.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from priortr.engine.result import PruneResult, StageResult

_HOMES = {
    "BEFORE_LLM": "priortr.engine.config",
    "DEFAULT_LAYER": "priortr.engine.config",
    "HEAD_AGGREGATIONS": "priortr.engine.config",
    "POSTERIOR_ROWS": "priortr.engine.config",
    "PruningConfig": "priortr.engine.config",
    "PruningSkippedWarning": "priortr.engine.config",
    "VISION_NEEDS": "priortr.engine.evidence",
    "PruningEngine": "priortr.engine.hooks",
    "PruneResult": "priortr.engine.result",
    "StageResult": "priortr.engine.result",
}

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


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use, and keep the name here for the next one."""
    if name not in _HOMES:
        raise AttributeError(f"module 'priortr.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
