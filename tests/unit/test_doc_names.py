"""Every ``priortr...`` name that README.md and docs/ use exists: each dotted name (``priortr.apply``,
``priortr.engine.pools``, ``priortr.frontend.loading.load``) and each ``from priortr... import a, b``
resolves, so a module that moves, or a public name that goes, takes its docs with it."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOTTED = re.compile(r"(?<![\w./-])priortr(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"from (priortr(?:\.\w+)*) import (\([\w, \n]+\)|[\w, ]+)")
FILES = (".py", ".json", ".md", ".safetensors", ".png", ".jsonl")


def doc_names() -> set[str]:
    names = set()
    for page in PAGES:
        text = page.read_text()
        for match in DOTTED.finditer(text):
            name = match.group(0)
            if not any(text.startswith(suffix, match.end()) for suffix in FILES) and not name.endswith(FILES):
                names.add(name)
        for module, imported in FROM_IMPORT.findall(text):
            names |= {f"{module}.{name.strip()}" for name in imported.strip("()").split(",") if name.strip()}
    return names


def resolve(name: str) -> object:
    """The module or attribute ``name`` names: the longest importable prefix, then attributes."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[end:]:
            value = getattr(value, attribute)
        return value
    raise ModuleNotFoundError(name)


NAMES = sorted(doc_names())


def test_the_docs_name_priortr_things():
    assert len(NAMES) > 20
    assert "priortr.apply" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_a_name_the_docs_use_exists(name):
    resolve(name)


def test_a_moved_name_is_caught():
    """Negative control: a module's old home does not resolve."""
    with pytest.raises((ModuleNotFoundError, AttributeError)):
        resolve("priortr.probe.attention_rows")
