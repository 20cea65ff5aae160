"""The paper's FLOPs and KV-cache columns (Table "Efficiency comparison on LLaVA-1.5-7B"), reproduced
with ``priortr.tools.flops``, and the assumptions that reproduce them (benchmarks/paper_flops.md).

    python benchmarks/paper_flops.py [--json]

prints our percentages next to the paper's for FastV, PriorTR and PyramidDrop at K = 192/128/64.
``paper_fit_error`` is the measure the search over assumptions minimised (benchmarks/paper_flops.md).
Research only: the library's formulas are ``priortr.tools.flops``; this file is not installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: python benchmarks/paper_flops.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from priortr.tools.flops import DEFAULT_DECODE_STEPS, DEFAULT_TEXT_TOKENS, TERMS, flops_report

PAPER_FLOPS_PERCENT: dict[str, dict[int, float]] = {
    "fastv": {192: 49.5, 128: 41.1, 64: 32.8},
    "priortr": {192: 49.5, 128: 41.1, 64: 32.8},
    "pdrop": {192: 70.0, 128: 63.3, 64: 55.4},
    "sparsevlm": {192: 45.7, 128: 36.8, 64: 28.1},
}
PAPER_KV_CACHE_MB: dict[str, dict[int, int]] = {
    "vanilla": {576: 312},
    "fastv": {192: 120, 128: 88, 64: 56},
    "priortr": {192: 120, 128: 88, 64: 56},
    "pdrop": {192: 205, 128: 182, 64: 156},
    "sparsevlm": {192: 128, 128: 97, 64: 66},
}


@dataclass(frozen=True)
class PaperProtocol:
    """The assumptions that reproduce the paper's FLOPs column (Table "Efficiency comparison on
    LLaVA-1.5-7B"); see benchmarks/paper_flops.md for the search that chose them.

    - 48 text tokens: the prompt of the paper's own KV-cache column (312 MiB = 624 tokens = 576 + 48).
    - 63 decode steps: ``generate(max_new_tokens=64)`` (the prefill yields the first token).
    - 2 full layers: the paper's Eq. with L = 2, which is FastV's K = 2 (this package's ``layer=1``);
      the paper gives FastV and PriorTR the same FLOPs, so both are counted with L = 2.
    - every term (ViT, projector, prefill, decode, LM head), the paper's formula, logits of the last
      prefill position only.
    """

    model: str = "llava-1.5-7b"
    text_tokens: int = DEFAULT_TEXT_TOKENS
    decode_steps: int = DEFAULT_DECODE_STEPS
    full_layers: int = 2
    terms: tuple[str, ...] = TERMS
    exact: bool = False
    all_prefill_logits: bool = False


PAPER_PROTOCOL = PaperProtocol()
REPRODUCED_METHODS: tuple[str, ...] = ("fastv", "priortr", "pdrop")


def paper_reproduction(protocol: PaperProtocol = PAPER_PROTOCOL) -> dict[str, Any]:
    """Our FLOPs percentages next to the paper's, for FastV, PriorTR and PyramidDrop at K = 192/128/64."""
    report = flops_report(
        protocol.model,
        tuple(PAPER_FLOPS_PERCENT["fastv"]),
        methods=REPRODUCED_METHODS,
        layer=protocol.full_layers - 1,
        text_tokens=protocol.text_tokens,
        decode_steps=protocol.decode_steps,
        full_layers=protocol.full_layers,
        exact=protocol.exact,
        all_prefill_logits=protocol.all_prefill_logits,
        terms=protocol.terms,
    )
    rows = []
    for row in report["rows"]:
        paper = PAPER_FLOPS_PERCENT[row["method"]][row["kept"]]
        rows.append(
            {
                "method": row["method"],
                "kept": row["kept"],
                "paper_percent": paper,
                "ours_percent": round(row["percent"], 2),
                "difference": round(row["percent"] - paper, 2),
                "paper_kv_cache_mb": PAPER_KV_CACHE_MB[row["method"]][row["kept"]],
                "ours_kv_cache_mib": round(row["kv_cache_bytes"] / 2**20, 1),
            }
        )
    return {"protocol": asdict(protocol), "assumptions": report["assumptions"], "rows": rows}


def paper_fit_error(protocol: PaperProtocol = PAPER_PROTOCOL, methods: Sequence[str] = ("fastv",)) -> float:
    """Largest |ours - paper| in percentage points over ``methods`` x {192, 128, 64}."""
    rows = paper_reproduction(protocol)["rows"]
    return max(abs(row["difference"]) for row in rows if row["method"] in methods)


def format_paper_table(result: dict[str, Any]) -> str:
    """Markdown of ``paper_reproduction``: the paper's numbers and ours, side by side."""
    protocol = result["protocol"]
    lines = [
        f"Paper FLOPs column reproduced on {protocol['model']}: {protocol['text_tokens']} text tokens, "
        f"{protocol['decode_steps']} decode steps, L = {protocol['full_layers']} full layers "
        f"(this package's layer={protocol['full_layers'] - 1}), terms: {', '.join(protocol['terms'])}.",
        "",
        "| method | K | FLOPs, paper | FLOPs, ours | ours - paper | KV cache, paper (MB) "
        "| KV cache, ours (MiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['method']} | {row['kept']} | {row['paper_percent']:.1f}% | {row['ours_percent']:.1f}% "
            f"| {row['difference']:+.2f} | {row['paper_kv_cache_mb']} | {row['ours_kv_cache_mib']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the paper's FLOPs and KV-cache columns next to ours (Markdown, or JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    result = paper_reproduction()
    print(json.dumps(result) if args.json else format_paper_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
