"""``priortr methods``: list every method from the registry's catalog (``priortr.methods.catalog``),
which is plain JSON, so the listing needs no torch and answers at once. Where the registry is already
imported (``main`` called from Python, after methods were registered at run time), the live registry
is listed instead."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# priortr/methods/catalog.json, read by path: importing priortr.methods would import torch
CATALOG = Path(__file__).parents[1] / "methods" / "catalog.json"
WHERE = {
    "vision": "before the LLM",
    "layer": "after decoder layer L",
    "layers": "after several decoder layers",
}


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("methods", help="list every method", description=run.__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.set_defaults(check=None, run=run)


def run(args: argparse.Namespace) -> int:
    """List every method: the name ``--method`` takes, where it prunes, its knobs and its source paper."""
    rows = [
        {
            "name": entry["name"],
            "where": WHERE[entry["where"]],
            "knobs": ", ".join(f"{knob}={default}" for knob, default in entry["knobs"].items()),
            "source": entry["source"],
        }
        for entry in entries()
    ]
    if args.json:
        print(json.dumps(rows))
        return 0
    widths = {key: max(len(key), *(len(row[key]) for row in rows)) for key in ("name", "where")}
    for row in rows:
        print(f"{row['name']:<{widths['name']}}  {row['where']:<{widths['where']}}  {row['source']}")
        if row["knobs"]:
            print(f"{'':<{widths['name']}}  options: {row['knobs']}")
    return 0


def entries() -> list[dict[str, Any]]:
    """The live registry's entries if ``priortr.methods`` is imported already, else the catalog's."""
    if "priortr.methods" in sys.modules:
        from priortr.methods.catalog import entries as live

        return live()
    return json.loads(CATALOG.read_text())
