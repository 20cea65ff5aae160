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

from priortr.flops import profile_of_stages
from priortr.methods import get_method
from priortr.testbed import VANILLA
from priortr.testbed.significance import mcnemar, wilson_interval

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


def where(method: str, layer: int | None) -> str:
    """Where the method prunes, in this library's 0-indexed scored-layer convention."""
    info = get_method(method)
    if info.where == "vision":
        return "before the LLM"
    if info.where == "layers":
        return "own schedule"
    return f"layer {info.default_layer if layer is None else layer}"


def mean_visual(label: str, budget: int) -> float:
    """Visual tokens per decoder layer in the prefill, averaged over the layers, from the method's
    stages (a schedule's stated counts; SparseVLM's recycled tokens come on top of them)."""
    method, _, place = label.partition(" @ ")
    info = get_method(method)
    layer = int(place.removeprefix("layer ")) if place.startswith("layer ") else info.default_layer
    if info.schedule is not None:
        stages = info.schedule(budget, N_VISUAL, layer, N_LAYERS)
    else:
        stages = [(-1 if info.where == "vision" else layer, budget)]
    return sum(profile_of_stages(stages).visual_per_layer(N_VISUAL, N_LAYERS)) / N_LAYERS


def collect(root: Path, split: str) -> tuple[int, Hits, dict[str, dict[int, Hits]]]:
    """Question count, vanilla's hits and, per row label (``method @ where``), the hits per budget."""
    rows: dict[str, dict[int, Hits]] = {}
    vanilla: Hits = []
    n = 0
    for run in RUNS:
        settings, hits = read_hits(root / f"{split}-{run}" / f"{split}.samples.jsonl")
        n = settings["limit"]
        for (method, budget), cell in hits.items():
            if method == VANILLA:
                vanilla = cell
            else:
                rows.setdefault(f"{method} @ {where(method, settings['layer'])}", {})[budget] = cell
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
    header = ["| method | " + " | ".join(f"K = {b}" for b in BUDGETS) + " |", "|---|" + "---:|" * 4]
    out = [f"### {split}: {n} questions", "", "Accuracy % (95% Wilson interval).", "", *header]
    out.append("| vanilla (all 576) | " + " | ".join(accuracy(vanilla) for _ in BUDGETS) + " |")
    for label, cells in rows.items():
        out.append(f"| {label} | " + " | ".join(accuracy(cells[b]) for b in BUDGETS) + " |")
    out += ["", "Visual tokens per decoder layer in the prefill, mean over the 30 layers (vanilla 576):", ""]
    out += header
    for label in rows:
        out.append(f"| {label} | " + " | ".join(f"{mean_visual(label, b):.0f}" for b in BUDGETS) + " |")
    for reference in [label for label in rows if label.startswith("priortr @")]:
        out += ["", f"{reference} against each method (McNemar, {n} paired questions):", "", *header]
        out.append("| vanilla | " + " | ".join(paired(rows[reference][b], vanilla) for b in BUDGETS) + " |")
        for label, cells in rows.items():
            if not label.startswith("priortr @"):
                out.append(
                    f"| {label} | " + " | ".join(paired(rows[reference][b], cells[b]) for b in BUDGETS) + " |"
                )
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="folder holding <split>-default/ and <split>-layer4/")
    parser.add_argument("--splits", nargs="+", default=list(SPLITS))
    args = parser.parse_args()
    print("\n".join(split_tables(args.root, split) for split in args.splits))


if __name__ == "__main__":
    main()
