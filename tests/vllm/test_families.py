"""The family table (``family_contract.FAMILIES``) covers every family the plug-in serves, and every row
runs the contract: a family the plug-in starts serving without a row, or a row without its
``FamilyContract`` class, fails here instead of going untested."""

from __future__ import annotations

import importlib
from pathlib import Path

from priortr.integrations.vllm.architectures import SERVED, UNSERVED
from tests.vllm.family_contract import FAMILIES, FamilyContract


def contract_classes() -> dict[str, list[type]]:
    """Each row's ``FamilyContract`` subclasses (the ``Test*`` ones pytest collects) in this folder's
    test modules."""
    for module in sorted(Path(__file__).parent.glob("test_*.py")):
        importlib.import_module(f"tests.vllm.{module.stem}")
    found: dict[str, list[type]] = {}
    pending = list(FamilyContract.__subclasses__())
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        if cls.__name__.startswith("Test"):
            found.setdefault(cls.family, []).append(cls)
    return found


def test_every_served_architecture_has_a_row():
    assert {row.architecture for row in FAMILIES.values()} == set(SERVED)
    assert not {row.architecture for row in FAMILIES.values()} & set(UNSERVED)


def test_every_row_runs_the_contract_once():
    classes = contract_classes()
    assert sorted(classes) == sorted(FAMILIES)
    assert all(len(found) == 1 for found in classes.values()), classes
