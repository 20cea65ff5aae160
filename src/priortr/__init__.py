"""priortr: prior-corrected visual token reduction (PriorTR) for Hugging Face multimodal LLMs.

handle = priortr.apply(model, method="priortr", budget=64, layer=2)
model.generate(**inputs)          # unchanged call, pruned prefill
handle.last.kept                  # what was kept
handle.remove()                   # the stock model again
"""

from priortr.adapters import register_adapter, supported_model_types
from priortr.api import PruningHandle, apply
from priortr.engine import PruneResult, PruningSkippedWarning, StageResult
from priortr.methods import (
    MethodInfo,
    available_methods,
    available_rules,
    get_method,
    get_rule,
    register_method,
    register_rule,
)
from priortr.scoring import Evidence
from priortr.selection import Selection, StageInputs

__all__ = [
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
    "get_method",
    "get_rule",
    "register_adapter",
    "register_method",
    "register_rule",
    "supported_model_types",
]
__version__ = "0.1.0"
