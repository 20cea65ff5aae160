"""The all-methods accuracy tables of docs/accuracy.md, from the answer journals of ``priortr eval``.

Reads ``<root>/<split>-default/<split>.samples.jsonl`` (every method at its own default layer) and
``<root>/<split>-layer4/<split>.samples.jsonl`` (the one-layer methods scored at layer 4) and prints
per split: each cell's accuracy with its 95% Wilson interval, then the exact McNemar test of PriorTR
against every other method on the same questions (``priortr.testbed.significance``).

    python benchmarks/accuracy_table.py benchmarks/results/accuracy
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

from priortr.methods import get_method
from priortr.testbed import VANILLA
from priortr.testbed.significance import mcnemar, wilson_interval
from priortr.tools.flops import profile_of_stages

SPLITS = ("scenes-test", "easy-vqa-test")
RUNS = ("default", "layer4")
BUDGETS = (192, 128, 64, 32)
N_VISUAL, N_LAYERS = 576, 30  # the testbed: 24 x 24 visual tokens, SmolLM2-135M's 30 decoder layers
Hits = list[int]  # 1 or 0 per question, in question order


def read_hits(path: Path) -> tuple[dict, dict[tuple[str, int | None], Hits]]:
    """The settings line and the per-cell hits of one answer journal; a cell missing an answer raises."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    settings, records = lines[0]["settings"], lines[1:]
    answers: dict[tuple[str, int | None], dict[int, int]] = {}
    for record in records:
        answers.setdefault((record["method"], record["budget"]), {})[record["index"]] = int(record["correct"])
    n = settings["limit"]
    for cell, by_index in answers.items():
        if sorted(by_index) != list(range(n)):
            raise ValueError(f"{path}: cell {cell} has {len(by_index)} of {n} answers; finish it (--resume)")
    return settings, {cell: [by_index[i] for i in range(n)] for cell, by_index in answers.items()}


class Row(NamedTuple):
    """A method and the decoder layer it scored (None: it prunes before the LLM or on its own schedule)."""

    method: str
    layer: int | None

    @property
    def label(self) -> str:
        """``method @ where``, in this library's 0-indexed scored-layer convention."""
        where = get_method(self.method).where
        place = {"vision": "before the LLM", "layers": "own schedule"}.get(where, f"layer {self.layer}")
        return f"{self.method} @ {place}"


def mean_visual(row: Row, budget: int) -> float:
    """Visual tokens per decoder layer in the prefill, averaged over the layers, from the method's
    stages (a schedule's stated counts; SparseVLM's recycled tokens come on top of them)."""
    info = get_method(row.method)
    if info.schedule is not None:
        stages = info.schedule(budget, N_VISUAL, N_LAYERS)
    else:
        stages = [(-1 if info.where == "vision" else row.layer, budget)]
    return sum(profile_of_stages(stages).visual_per_layer(N_VISUAL, N_LAYERS)) / N_LAYERS


def collect(root: Path, split: str) -> tuple[int, Hits, dict[Row, dict[int, Hits]]]:
    """Question count, vanilla's hits and, per row, the hits per budget."""
    rows: dict[Row, dict[int, Hits]] = {}
    vanilla: Hits = []
    n = 0
    for run in RUNS:
        settings, hits = read_hits(root / f"{split}-{run}" / f"{split}.samples.jsonl")
        n = settings["limit"]
        for (method, budget), cell in hits.items():
            if method == VANILLA:
                vanilla = cell
                continue
            layer = get_method(method).default_layer
            if layer is not None and settings["layer"] is not None:
                layer = settings["layer"]
            rows.setdefault(Row(method, layer), {})[budget] = cell
    return n, vanilla, rows


def accuracy(hits: Hits) -> str:
    lo, hi = wilson_interval(sum(hits), len(hits))
    return f"{100 * sum(hits) / len(hits):.0f} ({100 * lo:.0f}-{100 * hi:.0f})"


def paired(a: Hits, b: Hits) -> str:
    test = mcnemar(a, b)
    p = f"{test.p_value:.3f}" if test.p_value >= 0.001 else "<0.001"
    return f"{test.only_a}/{test.only_b}, p={p}"


def split_tables(root: Path, split: str) -> str:
    n, vanilla, rows = collect(root, split)
    columns = " | ".join(f"K = {b}" for b in BUDGETS)
    header = [f"| method | {columns} |", "|---|" + "---:|" * len(BUDGETS)]
    out = [f"### {split}: {n} questions", "", "Accuracy % (95% Wilson interval).", "", *header]
    out.append(f"| vanilla (all {N_VISUAL}) | " + " | ".join(accuracy(vanilla) for _ in BUDGETS) + " |")
    for row, cells in rows.items():
        out.append(f"| {row.label} | " + " | ".join(accuracy(cells[b]) for b in BUDGETS) + " |")
    tokens = f"mean over the {N_LAYERS} layers (vanilla {N_VISUAL})"
    out += ["", f"Visual tokens per decoder layer in the prefill, {tokens}:", "", *header]
    for row in rows:
        out.append(f"| {row.label} | " + " | ".join(f"{mean_visual(row, b):.0f}" for b in BUDGETS) + " |")
    references = [row for row in rows if row.method == "priortr"]
    for reference in references:
        out += ["", f"{reference.label} against each method (McNemar, {n} paired questions):", "", *header]
        out.append("| vanilla | " + " | ".join(paired(rows[reference][b], vanilla) for b in BUDGETS) + " |")
        for row, cells in rows.items():
            if row not in references:
                pairs = " | ".join(paired(rows[reference][b], cells[b]) for b in BUDGETS)
                out.append(f"| {row.label} | {pairs} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="folder holding <split>-default/ and <split>-layer4/")
    parser.add_argument("--splits", nargs="+", default=list(SPLITS))
    args = parser.parse_args()
    print("\n".join(split_tables(args.root, split) for split in args.splits))


if __name__ == "__main__":
    main()
