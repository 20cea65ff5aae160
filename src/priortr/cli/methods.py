"""``priortr methods``: list every method from the registry's catalog (``priortr.methods.catalog``),
which is plain JSON, so the listing needs no torch and answers at once. Where the registry is already
imported (``main`` called from Python, after methods were registered at run time), the live registry
is listed instead."""

from __future__ import annotations

import argparse
import ast
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
    """List every method: the name ``--method`` takes, where it prunes (and the layer it scores by
    default), its knobs and its source paper."""
    if args.json:  # knobs as JSON values, the default layer as a field of its own
        rows = [
            {
                "name": entry["name"],
                "where": WHERE[entry["where"]],
                "default_layer": entry["layer"],
                "knobs": {knob: ast.literal_eval(default) for knob, default in entry["knobs"].items()},
                "summary": entry["summary"],
                "source": entry["source"],
            }
            for entry in entries()
        ]
        print(json.dumps(rows))
        return 0
    rows = [
        {
            "name": entry["name"],
            "where": WHERE[entry["where"]] + _default(entry["layer"]),
            "knobs": ", ".join(f"{knob}={default}" for knob, default in entry["knobs"].items()),
            "source": entry["source"],
        }
        for entry in entries()
    ]
    widths = {key: max(len(key), *(len(row[key]) for row in rows)) for key in ("name", "where")}
    for row in rows:
        print(f"{row['name']:<{widths['name']}}  {row['where']:<{widths['where']}}  {row['source']}")
        if row["knobs"]:
            print(f"{'':<{widths['name']}}  options: {row['knobs']}")
    return 0


def _default(layer: int | None) -> str:
    return "" if layer is None else f" (default {layer})"


def default_layers() -> str:
    """The layer each one-layer method scores by default, for the ``--layer`` help: ``1 for dart,
    fastv; 2 for the others``."""
    layers: dict[int, list[str]] = {}
    for entry in entries():
        if entry["layer"] is not None:
            layers.setdefault(entry["layer"], []).append(entry["name"])
    usual = max(layers, key=lambda layer: len(layers[layer]))
    special = [f"{layer} for {', '.join(names)}" for layer, names in sorted(layers.items()) if layer != usual]
    return "; ".join([*special, f"{usual} for the others"])


def entries() -> list[dict[str, Any]]:
    """The live registry's entries if ``priortr.methods`` is imported already, else the catalog's."""
    if "priortr.methods" in sys.modules:
        from priortr.methods.catalog import entries as live

        return live()
    return json.loads(CATALOG.read_text())
