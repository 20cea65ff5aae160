"""What ``priortr calibrate`` writes of a ``Calibration``: its JSON document, its markdown table, its plot
(agreement against speed-up) and the files of a run (``write``), with a config file per recommendation."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from priortr.api import apply_defaults
from priortr.config_file import write_config
from priortr.tools.calibrate import Calibration, Measurement


def to_dict(result: Calibration) -> dict[str, Any]:
    front = {m.setting.key for m in result.pareto()}
    recommended = {method: m.setting.key if m else None for method, m in result.recommendations().items()}
    return {
        "model": result.model,
        "data": result.data,
        "prompts": result.prompt_ids,
        "answer_tokens": result.tokens,
        "target": result.target,
        "rank_by": result.rank_by,
        "unpruned": {
            "lm_prefill_ms": result.unpruned.median,
            "lm_prefill": asdict(result.unpruned),
            "replies": result.reference.replies,
        },
        "recommended": recommended,
        "measurements": [
            {
                "key": m.setting.key,
                "pareto": m.setting.key in front,
                **{k: v for k, v in asdict(m).items() if k != "timing"},
                "lm_prefill_ms": m.timing.lm_prefill.median,
                "lm_prefill": asdict(m.timing.lm_prefill),
                "speedup": m.speedup,
                "speedup_resolved": m.resolved,
            }
            for m in result.measurements
        ],
    }


def to_markdown(result: Calibration) -> str:
    front = {m.setting.key for m in result.pareto()}
    chosen = {m.setting.key for m in result.recommendations().values() if m is not None}
    lines = [
        f"Model `{result.model}`, data `{result.data}` ({len(result.prompt_ids)} prompts, answers of up to "
        f"{result.tokens} tokens); unpruned LM prefill {result.unpruned} ms (first prompt; median "
        "[quartiles] or range, every configuration timed in the same interleaved rounds). Target "
        f"agreement {result.target:.2f}. P: on the Pareto front (agreement vs speed-up); R: recommended "
        "for its method; (!): a speed-up within the spread of the timings.",
        "",
        "| method | layer | K | agreement | KL (nats) | LM prefill ms | speed-up | FLOPs | kept | |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    ordered = sorted(result.measurements, key=lambda m: (m.method, m.layer or -1, -m.budget))
    for m in ordered:
        marks = ("P" if m.setting.key in front else "") + ("R" if m.setting.key in chosen else "")
        lines.append(
            f"| {m.method} | {'-' if m.layer is None else m.layer} | {m.budget} | {m.agreement:.3f} | "
            f"{m.kl:.4f} | {m.timing.lm_prefill} | {speedup_text(m)} | {m.flops_share:.3f} | "
            f"{m.mean_kept:.0f} | {marks} |"
        )
    speed = "measured speed-up, FLOPs share within noise" if result.rank_by == "speedup" else "FLOPs share"
    lines += ["", f"Recommended (fastest by {speed} with agreement >= target):", ""]
    for method, m in result.recommendations().items():
        if m is None:
            top = max((x for x in result.measurements if x.method == method), key=lambda x: x.agreement)
            lines.append(
                f"- {method}: none reaches {result.target:.2f} (most faithful: {top.setting.label}, "
                f"{top.agreement:.3f}); measure larger budgets or other layers"
            )
        else:
            shown = speedup_text(m)
            lines.append(
                f"- {method}: {m.setting.label}, agreement {m.agreement:.3f}, speed-up {shown}, "
                f"FLOPs share {m.flops_share:.3f} (`recommended-{method}.json`)"
            )
    lines += [f"\nwarning: {line}" for line in noise_warnings(ordered)]
    return "\n".join(lines) + "\n"


def plot(result: Calibration, path: str | Path) -> Path:
    """Agreement against measured speed-up, one curve per method (and layer), the Pareto front marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.2, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    curves = dict.fromkeys((m.method, m.layer) for m in result.measurements)
    for method, layer in curves:
        points = sorted(
            (m for m in result.measurements if (m.method, m.layer) == (method, layer)),
            key=lambda m: -m.budget,
        )
        label = method if layer is None else f"{method} L{layer}"
        ax.plot([m.speedup for m in points], [m.agreement for m in points], marker="o", label=label)
    noisy = [m for m in result.measurements if not m.resolved]
    if noisy:
        ax.scatter(
            [m.speedup for m in noisy],
            [m.agreement for m in noisy],
            marker="x",
            color="black",
            zorder=3,
            label="speed-up within noise",
        )
    front = sorted(result.pareto(), key=lambda m: m.speedup)
    ax.plot(
        [m.speedup for m in front],
        [m.agreement for m in front],
        color="black",
        linestyle="--",
        marker="s",
        markerfacecolor="none",
        markersize=11,
        label="Pareto front",
    )
    ax.axhline(result.target, color="grey", linewidth=1, linestyle=":", label=f"target {result.target:.2f}")
    ax.set_xlabel("measured LM prefill speed-up (x)")
    ax.set_ylabel("agreement with the unpruned model")
    ax.set_title(
        f"{Path(result.model).name or result.model} on {result.data} ({len(result.prompt_ids)} prompts)"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def write(result: Calibration, directory: str | Path) -> list[Path]:
    """``calibration.{json,md,png}``, and a ``recommended-<method>.json`` config per method that
    reaches the target plus ``recommended.json``, the fastest of them."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "calibration.json", directory / "calibration.md"]
    paths[0].write_text(json.dumps(to_dict(result), indent=2) + "\n")
    paths[1].write_text(to_markdown(result))
    paths.append(plot(result, directory / "calibration.png"))
    for path in directory.glob("recommended*.json"):
        path.unlink()  # a recommendation of an earlier run must not outlive a run that makes none
    for method, m in result.recommendations().items():
        if m is not None:
            paths.append(
                write_config(
                    directory / f"recommended-{method}.json",
                    m.setting.arguments(),
                    apply_defaults(),
                    _record(result, m),
                )
            )
    best = result.best()
    if best is not None:
        paths.append(
            write_config(
                directory / "recommended.json",
                best.setting.arguments(),
                apply_defaults(),
                _record(result, best),
            )
        )
    return paths


def _record(result: Calibration, m: Measurement) -> dict[str, Any]:
    return {
        "model": result.model,
        "data": result.data,
        "prompts": len(result.prompt_ids),
        "target": result.target,
        "rank_by": result.rank_by,
        "agreement": round(m.agreement, 4),
        "kl": round(m.kl, 5),
        "speedup": round(m.speedup, 3),
        "speedup_resolved": m.resolved,
        "flops_share": round(m.flops_share, 4),
    }


def speedup_text(m: Measurement) -> str:
    """``1.52x``, or ``0.98x (!)`` where the timings do not resolve it."""
    return f"{m.speedup:.2f}x" + ("" if m.resolved else " (!)")


def noise_warnings(measurements: Iterable[Measurement]) -> list[str]:
    """One line per speed-up (marked (!)) that the spread of the timings cannot support."""
    return [
        f"{m.setting.label}: the LM prefill medians differ by less than the spread of the timings "
        f"({max(m.timing.lm_prefill.width, m.timing.unpruned.width):.2f} ms); the speed-up "
        f"{m.speedup:.2f}x is within noise and ranks as none (its FLOPs share, {m.flops_share:.3f}, "
        "is what pruning saves): add --repeats or free the machine"
        for m in measurements
        if not m.resolved
    ]
