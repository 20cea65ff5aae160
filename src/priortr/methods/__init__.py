"""Pruning methods, one module each, all in one registry (``registry``).

The contract every method shares sits here too: ``selection`` (``StageInputs`` in, ``Selection`` out),
``scoring`` (evidence Q, P and the last row, budgets, top-K), ``value_checks`` (whether checks that read
tensor values run). A method module holds its selector, its schedule, its knobs and its registration;
importing this package registers every built-in method. Shared pieces sit beside them: ``validate``
(evidence and knob validation), ``tokens`` and ``groups`` (building a Selection), ``clustering`` and
``recycling`` (SparseVLM's token recycling, reused by PriorTR+Merging). A new method is one new module
imported here.
"""

from priortr.methods import (  # noqa: F401  (registration)
    ablations,
    clse,
    dart,
    divprune,
    downsample,
    fastv,
    pdrop,
    priortr,
    prumerge,
    sparsevlm,
    visionzip,
    vispruner,
)
from priortr.methods.registry import (
    NEEDS,
    WHERE,
    MethodInfo,
    Rule,
    Schedule,
    Selector,
    available_methods,
    available_rules,
    get_method,
    get_rule,
    register_method,
    register_rule,
)

__all__ = [
    "NEEDS",
    "WHERE",
    "MethodInfo",
    "Rule",
    "Schedule",
    "Selector",
    "available_methods",
    "available_rules",
    "get_method",
    "get_rule",
    "register_method",
    "register_rule",
]
