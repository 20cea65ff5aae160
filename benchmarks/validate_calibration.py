"""Does the label-free agreement of ``priortr calibrate`` predict labelled accuracy? (docs/calibration.md)

    .venv/bin/python benchmarks/validate_calibration.py --train CAL/scenes-train \
        --test CAL/scenes-test CAL/easy-vqa-test --out benchmarks/results/calibration

Each folder is a ``priortr calibrate --out`` folder run on a testbed split; its ``calibration.json``
holds every configuration's replies, which are scored here against the split's reference answers (the
same first-word rule as ``priortr eval``). Per test split: the Spearman rank correlation of agreement
(and of -KL) with accuracy across the grid, a scatter plot, and the configuration calibrated on the
training split next to the one test labels would have chosen by the same rule (the fastest whose
accuracy retention reaches the target), and the most accurate grid point (the cheapest in FLOPs among
equals).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from priortr.testbed.data import load_split
from priortr.testbed.evaluate import is_correct


def ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def scored(folder: Path) -> dict:
    """``calibration.json`` of ``folder`` with an accuracy per configuration and for the unpruned model."""
    document = json.loads((folder / "calibration.json").read_text())
    samples = load_split(document["data"], len(document["prompts"]))
    ids = [f"{s.image_id}#{s.kind}" for s in samples]
    if ids != document["prompts"]:
        raise ValueError(f"{folder}: prompts are not {document['data']} with limit {len(ids)}")

    def accuracy(replies: list[str]) -> float:
        return sum(is_correct(s, r) for s, r in zip(samples, replies, strict=True)) / len(samples)

    document["unpruned"]["accuracy"] = accuracy(document["unpruned"]["replies"])
    for m in document["measurements"]:
        m["accuracy"] = accuracy(m["replies"])
    return document


def fastest(measurements: list[dict], floor: float) -> dict | None:
    """The fastest configuration whose accuracy reaches ``floor`` (calibration's rule, with labels)."""
    chosen = [m for m in measurements if m["accuracy"] >= floor]
    return max(chosen, key=lambda m: (m["speedup"], -m["flops_share"]), default=None)


def label(m: dict | None) -> str:
    return "none" if m is None else f"{m['method']} L{m['layer']} K={m['budget']}"


def plot(tests: dict[str, dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2 * len(tests), 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(tests), squeeze=False)[0]
    for ax, (name, document) in zip(axes, tests.items(), strict=True):
        for method in dict.fromkeys(m["method"] for m in document["measurements"]):
            points = [m for m in document["measurements"] if m["method"] == method]
            ax.scatter([m["agreement"] for m in points], [m["accuracy"] for m in points], label=method)
            for m in points:
                ax.annotate(f"L{m['layer']} K{m['budget']}", (m["agreement"], m["accuracy"]), fontsize=6)
        base = document["unpruned"]["accuracy"]
        ax.axhline(base, color="grey", linestyle="--", linewidth=1, label=f"unpruned {base:.2f}")
        rho = spearman(
            [m["agreement"] for m in document["measurements"]],
            [m["accuracy"] for m in document["measurements"]],
        )
        ax.set_title(f"{name} ({len(document['prompts'])} q): Spearman {rho:.2f}")
        ax.set_xlabel("agreement with the unpruned model (no labels)")
        ax.set_ylabel("accuracy (labels)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=Path, required=True, help="calibrate --out folder on scenes-train")
    parser.add_argument(
        "--test", type=Path, nargs="+", required=True, help="calibrate --out folders on test splits"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for validation.json and scatter.png")
    args = parser.parse_args()
    train = json.loads((args.train / "calibration.json").read_text())
    target = train["target"]
    recommended = dict(train["recommended"])
    faithful = {  # where no configuration reaches the target: the one closest to it on training prompts
        method: max(
            (m for m in train["measurements"] if m["method"] == method), key=lambda m: m["agreement"]
        )["key"]
        for method in recommended
    }
    tests = {}
    summary: dict = {
        "target": target,
        "recommended_on_train": recommended,
        "most_faithful_on_train": faithful,
        "tests": {},
    }
    for folder in args.test:
        document = scored(folder)
        tests[document["data"]] = document
        grid = document["measurements"]
        base = document["unpruned"]["accuracy"]
        by_key = {m["key"]: m for m in grid}
        accuracy = [m["accuracy"] for m in grid]
        rows = {
            "questions": len(document["prompts"]),
            "unpruned_accuracy": base,
            "spearman_agreement_accuracy": spearman([m["agreement"] for m in grid], accuracy),
            "spearman_minus_kl_accuracy": spearman([-m["kl"] for m in grid], accuracy),
            "grid": [
                {k: m[k] for k in ("key", "agreement", "kl", "accuracy", "speedup", "flops_share")}
                for m in grid
            ],
            "per_method": {},
        }
        for method in dict.fromkeys(m["method"] for m in grid):
            mine = [m for m in grid if m["method"] == method]
            chosen = by_key.get(recommended.get(method) or "")
            closest = by_key.get(faithful[method])
            best = max(mine, key=lambda m: (m["accuracy"], -m["flops_share"]))  # the cheapest of the best
            hindsight = fastest(mine, target * base)
            rows["per_method"][method] = {
                "recommended": label(chosen),
                "recommended_accuracy": None if chosen is None else chosen["accuracy"],
                "most_faithful_on_train": label(closest),
                "most_faithful_on_train_accuracy": None if closest is None else closest["accuracy"],
                "hindsight_same_rule": label(hindsight),
                "hindsight_accuracy": None if hindsight is None else hindsight["accuracy"],
                "most_accurate": label(best),
                "most_accurate_accuracy": best["accuracy"],
                "most_accurate_flops_share": best["flops_share"],
            }
        summary["tests"][document["data"]] = rows
        print(json.dumps({k: v for k, v in rows.items() if k != "grid"}, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "validation.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(tests, args.out / "scatter.png")
    print(f"wrote {args.out / 'validation.json'} and {args.out / 'scatter.png'}")


if __name__ == "__main__":
    main()
