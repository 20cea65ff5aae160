"""priortr: prior-corrected visual token reduction (PriorTR) for Hugging Face multimodal LLMs.

handle = priortr.apply(model, method="priortr", budget=64, layer=2)
model.generate(**inputs)          # unchanged call, pruned prefill
handle.last.kept                  # what was kept
handle.remove()                   # the stock model again (priortr.detach(model) without the handle)

The public names are imported on first use (PEP 562), so that ``import priortr`` is cheap: the
``priortr`` command answers ``--help`` and ``methods`` without importing torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from priortr.adapters import register_adapter, supported_model_types
    from priortr.api import PruningHandle, apply, detach
    from priortr.engine.config import DegenerateScoresWarning, PruningSkippedWarning
    from priortr.engine.result import PruneResult, StageResult
    from priortr.methods import (
        MethodInfo,
        available_methods,
        available_rules,
        get_method,
        get_rule,
        register_method,
        register_rule,
    )
    from priortr.methods.scoring import Evidence
    from priortr.methods.selection import Selection, StageInputs

# each public name (``__all__``) -> the module that defines it
_HOMES = {
    "register_adapter": "priortr.adapters",
    "supported_model_types": "priortr.adapters",
    "PruningHandle": "priortr.api",
    "apply": "priortr.api",
    "detach": "priortr.api",
    "PruneResult": "priortr.engine.result",
    "PruningSkippedWarning": "priortr.engine.config",
    "DegenerateScoresWarning": "priortr.engine.config",
    "StageResult": "priortr.engine.result",
    "MethodInfo": "priortr.methods",
    "available_methods": "priortr.methods",
    "available_rules": "priortr.methods",
    "get_method": "priortr.methods",
    "get_rule": "priortr.methods",
    "register_method": "priortr.methods",
    "register_rule": "priortr.methods",
    "Evidence": "priortr.methods.scoring",
    "Selection": "priortr.methods.selection",
    "StageInputs": "priortr.methods.selection",
}

__all__ = [
    "DegenerateScoresWarning",
    "Evidence",
    "MethodInfo",
    "PruneResult",
    "PruningHandle",
    "PruningSkippedWarning",
    "Selection",
    "StageInputs",
    "StageResult",
    "apply",
    "available_methods",
    "available_rules",
    "detach",
    "get_method",
    "get_rule",
    "register_adapter",
    "register_method",
    "register_rule",
    "supported_model_types",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use, and keep the name here for the next one."""
    if name not in _HOMES:
        raise AttributeError(f"module 'priortr' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
