"""Does the prior term help with the paper's posterior rows? docs/accuracy.md's issue-48 table.

Reads two answer journals of ``priortr eval`` on the same seeded questions: ``new`` (PriorTR and its
posterior-only ablation with the default rows j >= i_e) and ``former`` (benchmarks/results/accuracy/
scenes-test-default: every method at its default, PriorTR with the former rows i_e+1 .. T-1), and
prints each cell's accuracy with its 95% Wilson interval and the exact McNemar test of the new PriorTR
against the others (``priortr.testbed.significance``).

    python -m benchmarks.prior_term_table benchmarks/results/accuracy/scenes-test-i48-k64 \
        benchmarks/results/accuracy/scenes-test-default --budgets 64
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.accuracy_table import read_hits
from priortr.testbed.significance import mcnemar, wilson_interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new", type=Path)
    parser.add_argument("former", type=Path)
    parser.add_argument("--budgets", type=int, nargs="+", default=[64])
    args = parser.parse_args()
    new_settings, new = read_hits(args.new)
    former_settings, former = read_hits(args.former)
    if (new_settings["split"], new_settings["limit"]) != (former_settings["split"], former_settings["limit"]):
        raise ValueError("the two journals answered different questions; run both with the same --limit")
    questions = len(new[("priortr", args.budgets[0])])
    for budget in args.budgets:
        rows = {
            "priortr (rows j >= i_e, default)": new[("priortr", budget)],
            "posterior (rows j >= i_e, default)": new[("posterior", budget)],
            "priortr (rows j > i_e, former default)": former[("priortr", budget)],
            "fastv (layer 1)": former[("fastv", budget)],
        }
        print(f"K = {budget}, {questions} questions")
        print("| method | accuracy % (95% Wilson) | priortr (default) only / other only | McNemar p |")
        print("| --- | ---: | ---: | ---: |")
        reference = rows["priortr (rows j >= i_e, default)"]
        for label, hits in rows.items():
            low, high = wilson_interval(sum(hits), len(hits))
            cell = f"{100 * sum(hits) / len(hits):.1f} ({100 * low:.1f}-{100 * high:.1f})"
            if hits is reference:
                print(f"| {label} | {cell} | | |")
                continue
            paired = mcnemar(reference, hits)
            print(f"| {label} | {cell} | {paired.only_a} / {paired.only_b} | {paired.p_value:.3f} |")


if __name__ == "__main__":
    main()
