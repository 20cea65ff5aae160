"""The accuracy tables of docs/accuracy.md, from the answer journals of ``priortr eval``.

Prints each cell's accuracy with its 95% Wilson interval, the visual tokens per decoder layer each
method leaves, then the exact McNemar test of PriorTR against every other method on the same questions
(``priortr.testbed.significance``). Either the all-methods grid, per split from
``<root>/<split>-default/`` (every method at its own default layer) and ``<root>/<split>-layer4/`` (the
one-layer methods scored at layer 4), or any journals of the same questions (``--journals``):

    python benchmarks/accuracy_table.py benchmarks/results/accuracy
    python benchmarks/accuracy_table.py --journals benchmarks/results/accuracy/scenes-test-400 \
        benchmarks/results/accuracy/scenes-test-400-clse --budgets 64 32

``--against downsample`` tests downsample, not PriorTR, against every other row.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from priortr.methods import get_method
from priortr.testbed import VANILLA
from priortr.testbed.significance import mcnemar, wilson_interval
from priortr.tools.flops import POOLS_A_GRID, pooled_count, profile_of_stages

SPLITS = ("scenes-test", "easy-vqa-test")
RUNS = ("default", "layer4")
BUDGETS = (192, 128, 64, 32)
N_VISUAL, N_LAYERS = 576, 30  # the testbed: 24 x 24 visual tokens, SmolLM2-135M's 30 decoder layers
Hits = list[int]  # 1 or 0 per question, in question order


def read_hits(path: Path) -> tuple[dict, dict[tuple[str, int | None], Hits]]:
    """The settings line and the per-cell hits of one answer journal (a folder's ``*.samples.jsonl``, or
    the file); a cell missing an answer raises. A journal of a whole split (``limit`` null) has as many
    questions as its highest index says."""
    if path.is_dir():
        path = next(path.glob("*.samples.jsonl"))
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    settings, records = lines[0]["settings"], lines[1:]
    answers: dict[tuple[str, int | None], dict[int, int]] = {}
    for record in records:
        answers.setdefault((record["method"], record["budget"]), {})[record["index"]] = int(record["correct"])
    n = settings["limit"] or 1 + max(record["index"] for record in records)
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
    stages (a schedule's stated counts; SparseVLM's recycled tokens come on top of them; downsample's
    pooled grid: 169 for K = 192)."""
    info = get_method(row.method)
    if info.schedule is not None:
        stages = info.schedule(budget, N_VISUAL, N_LAYERS)
    elif row.method in POOLS_A_GRID:
        stages = [(-1, pooled_count(budget, N_VISUAL))]
    else:
        stages = [(-1 if info.where == "vision" else row.layer, budget)]
    return sum(profile_of_stages(stages).visual_per_layer(N_VISUAL, N_LAYERS)) / N_LAYERS


def collect(journals: Sequence[Path]) -> tuple[int, Hits, dict[Row, dict[int, Hits]]]:
    """Question count, vanilla's hits and, per row, the hits per budget, from journals of one split's
    same seeded questions; a cell found in two journals raises."""
    rows: dict[Row, dict[int, Hits]] = {}
    vanilla: Hits | None = None
    questions: tuple[str, int] | None = None
    for path in journals:
        settings, hits = read_hits(path)
        asked = (settings["split"], len(next(iter(hits.values()))))
        if questions not in (None, asked):
            raise ValueError(
                f"{path} answered {asked} (split, questions), the journals before it {questions}"
            )
        questions = asked
        for (method, budget), cell in hits.items():
            if method == VANILLA:
                vanilla = cell
                continue
            layer = get_method(method).default_layer
            if layer is not None and settings["layer"] is not None:
                layer = settings["layer"]
            cells = rows.setdefault(Row(method, layer), {})
            if budget in cells:
                raise ValueError(f"{path}: {method} at K = {budget} is in an earlier journal too")
            cells[budget] = cell
    if vanilla is None or questions is None:
        raise ValueError("no journal holds the unpruned model's answers (method vanilla)")
    return questions[1], vanilla, rows


def accuracy(hits: Hits) -> str:
    lo, hi = wilson_interval(sum(hits), len(hits))
    return f"{100 * sum(hits) / len(hits):.0f} ({100 * lo:.0f}-{100 * hi:.0f})"


def paired(a: Hits, b: Hits) -> str:
    test = mcnemar(a, b)
    p = f"{test.p_value:.3f}" if test.p_value >= 0.001 else "<0.001"
    return f"{test.only_a}/{test.only_b}, p={p}"


def tables(
    title: str, journals: Sequence[Path], budgets: Sequence[int] | None = None, against: str = "priortr"
) -> str:
    """The accuracy, visual-token and paired tables of ``journals`` at ``budgets`` (all of ``BUDGETS``
    by default), under the heading ``title``; the paired tables test each row of method ``against``
    (PriorTR by default) against every other row."""
    budgets = BUDGETS if budgets is None else budgets
    n, vanilla, rows = collect(journals)
    columns = " | ".join(f"K = {b}" for b in budgets)
    header = [f"| method | {columns} |", "|---|" + "---:|" * len(budgets)]
    out = [f"### {title}: {n} questions", "", "Accuracy % (95% Wilson interval).", "", *header]
    out.append(f"| vanilla (all {N_VISUAL}) | " + " | ".join(accuracy(vanilla) for _ in budgets) + " |")
    for row, cells in rows.items():
        out.append(f"| {row.label} | " + " | ".join(accuracy(cells[b]) for b in budgets) + " |")
    tokens = f"mean over the {N_LAYERS} layers (vanilla {N_VISUAL})"
    out += ["", f"Visual tokens per decoder layer in the prefill, {tokens}:", "", *header]
    for row in rows:
        out.append(f"| {row.label} | " + " | ".join(f"{mean_visual(row, b):.0f}" for b in budgets) + " |")
    references = [row for row in rows if row.method == against]
    for reference in references:
        out += ["", f"{reference.label} against each method (McNemar, {n} paired questions):", "", *header]
        out.append("| vanilla | " + " | ".join(paired(rows[reference][b], vanilla) for b in budgets) + " |")
        for row, cells in rows.items():
            if row not in references:
                pairs = " | ".join(paired(rows[reference][b], cells[b]) for b in budgets)
                out.append(f"| {row.label} | {pairs} |")
    return "\n".join(out) + "\n"


def split_tables(root: Path, split: str) -> str:
    """The all-methods grid of ``split``: ``<root>/<split>-default/`` and ``<root>/<split>-layer4/``."""
    return tables(split, [root / f"{split}-{run}" for run in RUNS])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "root", type=Path, nargs="?", help="folder holding <split>-default/ and <split>-layer4/"
    )
    parser.add_argument("--splits", nargs="+", default=list(SPLITS))
    parser.add_argument("--journals", type=Path, nargs="+", help="journals of the same questions, instead")
    parser.add_argument("--budgets", type=int, nargs="+")
    parser.add_argument("--against", default="priortr", help="the method the paired tables test (--journals)")
    args = parser.parse_args()
    if args.journals:
        print(tables("journals", args.journals, args.budgets, args.against))
    elif args.root is not None:
        print("\n".join(split_tables(args.root, split) for split in args.splits))
    else:
        parser.error("give the grid's root folder or --journals")


if __name__ == "__main__":
    main()
