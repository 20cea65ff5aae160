"""The registry of built-in methods as data: ``catalog.json``, so that ``priortr methods`` lists them
without importing torch (``priortr.cli.methods`` reads the file by path).

The file is generated from the live registry and a test checks that the two agree; after registering,
renaming or re-documenting a method, regenerate it with ``python -m priortr.methods.catalog``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from priortr.methods.registry import available_methods, get_method

FILE = Path(__file__).with_name("catalog.json")


def entries() -> list[dict[str, Any]]:
    """Per registered method (sorted by name): where it prunes, the layer ``apply`` scores when none is
    named (None: it takes no layer), its summary and source, and its knobs with their defaults as
    Python literals."""
    rows = []
    for name in available_methods():
        info = get_method(name)
        knobs = {knob: repr(default) for knob, default in info.knobs.items()}
        rows.append(
            {
                "name": name,
                "where": info.where,
                "layer": info.default_layer,
                "summary": info.summary,
                "source": info.source,
                "knobs": knobs,
            }
        )
    return rows


if __name__ == "__main__":
    FILE.write_text(json.dumps(entries(), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {FILE}")
