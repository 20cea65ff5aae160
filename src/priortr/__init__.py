"""priortr: prior-corrected visual token reduction (PriorTR) for Hugging Face multimodal LLMs.

handle = priortr.apply(model, method="priortr", budget=64, layer=2)
model.generate(**inputs)          # unchanged call, pruned prefill
handle.last.kept                  # what was kept
handle.remove()                   # the stock model again
"""

from priortr.adapters import register_adapter, supported_model_types
from priortr.api import PruningHandle, apply
from priortr.engine import PruneResult, PruningSkippedWarning
from priortr.scoring import Evidence, available_rules, get_rule, register_rule

available_methods = available_rules

__all__ = [
    "Evidence",
    "PruneResult",
    "PruningHandle",
    "PruningSkippedWarning",
    "apply",
    "available_methods",
    "available_rules",
    "get_rule",
    "register_adapter",
    "register_rule",
    "supported_model_types",
]
__version__ = "0.1.0"
