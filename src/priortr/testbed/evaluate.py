"""Accuracy under pruning: methods x budgets over a named question split (``priortr eval``).

Every (method, budget) cell answers the same questions with greedy decoding, pruned by
``priortr.apply`` at the same layer; ``vanilla`` is the stock model with every visual token. A reply is
correct when its first word equals the one-word reference answer (case-insensitive). Retention is a
cell's accuracy over vanilla's, as in the paper's tables.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from priortr.api import apply
from priortr.frontend.prompts import prompt_text
from priortr.methods import get_method
from priortr.testbed import DEFAULT_BUDGETS, DEFAULT_METHODS, VANILLA
from priortr.testbed.data import Sample, iter_images
from priortr.tools.journal import Journal, write_whole


@dataclass
class Cell:
    """One method at one budget (``budget`` None: every visual token)."""

    method: str
    budget: int | None
    correct: int = 0
    total: int = 0
    kept_tokens: int = 0
    visual_tokens: int = 0
    by_kind: dict[str, list[int]] = field(default_factory=dict)  # kind -> [correct, total]
    hits: list[int] = field(default_factory=list)  # 1 or 0 per question, in question order

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")

    def add(self, sample: Sample, reply: str, kept: int, visual: int) -> None:
        hit = int(is_correct(sample, reply))
        self.hits.append(hit)
        self.correct += hit
        self.total += 1
        self.kept_tokens += kept
        self.visual_tokens += visual
        counts = self.by_kind.setdefault(sample.kind, [0, 0])
        counts[0] += hit
        counts[1] += 1


@dataclass
class Report:
    split: str
    model: str
    layer: int | None
    dtype: str
    cells: list[Cell]
    seconds: float = 0.0
    questions: int | None = None  # the split's size; None: the largest cell's

    @property
    def size(self) -> int:
        """Questions per complete cell."""
        return self.questions if self.questions is not None else max((c.total for c in self.cells), default=0)

    def partial(self, cell: Cell) -> bool:
        """The cell has answers to only some of the questions (an interrupted run)."""
        return cell.total < self.size

    @property
    def vanilla(self) -> Cell | None:
        return next((c for c in self.cells if c.method == VANILLA), None)

    def retention(self, cell: Cell) -> float | None:
        base = self.vanilla
        return cell.accuracy / base.accuracy if base is not None and base.accuracy > 0 else None

    def to_dict(self) -> dict[str, Any]:
        cells = []
        for cell in self.cells:
            row = asdict(cell)
            row["accuracy"] = cell.accuracy
            row["retention"] = self.retention(cell)
            row["mean_kept"] = cell.kept_tokens / cell.total if cell.total else None
            cells.append(row)
        return {
            "split": self.split,
            "model": self.model,
            "layer": self.layer,
            "dtype": self.dtype,
            "seconds": round(self.seconds, 1),
            "questions": self.size,
            "cells": cells,
        }

    def to_markdown(self) -> str:
        budgets = sorted({c.budget for c in self.cells if c.budget is not None}, reverse=True) or [None]
        lines = [
            f"Split `{self.split}` ({self.size} questions), model `{self.model}`, {self._layer_text()}, "
            f"{self.dtype}. Accuracy % (retention % of vanilla).",
            "",
            "| method | " + " | ".join(f"K = {b or 'all'}" for b in budgets) + " |",
            "|---|" + "---:|" * len(budgets),
        ]
        base = self.vanilla
        if base is not None:
            lines.append(
                f"| vanilla (all {base.visual_tokens // max(base.total, 1)}) | "
                + " | ".join(f"{100 * base.accuracy:.1f}{self._mark(base)}" for _ in budgets)
                + " |"
            )
        for method in dict.fromkeys(c.method for c in self.cells if c.method != VANILLA):
            row = {c.budget: c for c in self.cells if c.method == method}
            lines.append(f"| {method} | " + " | ".join(self._entry(row.get(b)) for b in budgets) + " |")
        kinds = sorted({k for c in self.cells for k in c.by_kind})
        lines += [
            "",
            "Accuracy % by question kind:",
            "",
            "| method | K | " + " | ".join(kinds) + " |",
            "|---|---:|" + "---:|" * len(kinds),
        ]
        for cell in self.cells:
            values = [cell.by_kind.get(k, [0, 0]) for k in kinds]
            lines.append(
                f"| {cell.method}{self._mark(cell)} | {cell.budget or 'all'} | "
                + " | ".join(f"{100 * c / t:.1f}" if t else "-" for c, t in values)
                + " |"
            )
        if any(map(self.partial, self.cells)):
            lines += ["", "[n/N]: a partial cell, n of the N questions answered so far (--resume finishes)"]
        return "\n".join(lines) + "\n"

    def _mark(self, cell: Cell) -> str:
        return f" [{cell.total}/{self.size}]" if self.partial(cell) else ""

    def _layer_text(self) -> str:
        return "each method's default layer" if self.layer is None else f"scored layer {self.layer}"

    def _entry(self, cell: Cell | None) -> str:
        if cell is None:
            return "-"
        retention = self.retention(cell)
        text = f"{100 * cell.accuracy:.1f}" + (f" ({100 * retention:.0f})" if retention is not None else "")
        return text + self._mark(cell)

    def plot(self, path: str | Path) -> Path:
        """Accuracy retention (% of vanilla) against the budget, a line per method."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 4.2))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        for method in dict.fromkeys(c.method for c in self.cells if c.method != VANILLA):
            cells = sorted((c for c in self.cells if c.method == method), key=lambda c: c.budget)
            ax.plot(
                [c.budget for c in cells],
                [100 * (self.retention(c) or 0) for c in cells],
                marker="o",
                label=method,
            )
        ax.axhline(100, color="grey", linestyle="--", linewidth=1, label="vanilla")
        ax.set_xlabel("visual tokens kept (K)")
        ax.set_ylabel("accuracy retention (% of vanilla)")
        base = self.vanilla
        title = f"{self.split}: " + (f"vanilla {100 * base.accuracy:.1f}%" if base is not None else "")
        ax.set_title(f"{title}, {self._layer_text()}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        return path

    def write(self, directory: str | Path, stem: str) -> list[Path]:
        """``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` in ``directory``, each replaced whole."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        document = json.dumps(self.to_dict(), indent=2) + "\n"
        return [
            write_whole(directory / f"{stem}.json", lambda path: path.write_text(document)),
            write_whole(directory / f"{stem}.md", lambda path: path.write_text(self.to_markdown())),
            write_whole(directory / f"{stem}.png", self.plot),
        ]


def first_word(reply: str) -> str:
    words = re.findall(r"[a-z0-9]+", reply.lower())
    return words[0] if words else ""


def is_correct(sample: Sample, reply: str) -> bool:
    """The reply's first word is the reference answer (case-insensitive)."""
    return first_word(reply) == sample.answer.lower()


def answer(model: nn.Module, processor: Any, pairs: Sequence[tuple[Sample, Any]], max_new_tokens: int = 4):
    """Greedy replies to a batch of (sample, image) pairs (left-padded, one prefill)."""
    processor.tokenizer.padding_side = "left"
    inputs = processor(
        images=[image for _, image in pairs],
        text=[prompt_text(processor, sample.question) for sample, _ in pairs],
        padding=True,
        return_tensors="pt",
    ).to(model.device, dtype=model.dtype)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def evaluate(
    model: nn.Module,
    processor: Any,
    samples: Sequence[Sample],
    split: str,
    batch_size: int = 8,
    progress: bool = True,
    **settings: Any,
) -> Report:
    """Answer every sample under every (method, budget) cell; vanilla runs once, unpruned. ``settings``
    are ``Evaluation``'s (methods, budgets, layer, model_name, journal, options)."""
    evaluation = Evaluation(model, processor, samples, split, **settings)
    evaluation.run(batch_size, progress)
    return evaluation.report()


class Evaluation:
    """One ``evaluate`` run, whose ``report()`` holds every answer recorded so far: after an interrupt
    it is the table of what finished.

    ``layer`` is the scored layer of the one-layer methods (None: each method's own default); methods
    that prune before the language model or on their own schedule of layers take none. ``options``:
    the pruned methods' knobs (``priortr.apply``'s ``options``). With a ``journal`` every answer is
    recorded as its batch finishes, and answers already recorded there are not asked again."""

    def __init__(
        self,
        model: nn.Module,
        processor: Any,
        samples: Sequence[Sample],
        split: str,
        methods: Sequence[str] = DEFAULT_METHODS,
        budgets: Sequence[int] = DEFAULT_BUDGETS,
        layer: int | None = None,
        model_name: str = "testbed",
        journal: Journal | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        if not samples:
            raise ValueError(f"split {split!r} has no samples to evaluate")
        self.model, self.processor, self.split, self.layer = model, processor, split, layer
        self.model_name, self.options = model_name, options
        self.samples = list(samples)
        self.cells = [(VANILLA, None)] if VANILLA in methods else []
        self.cells += [(m, b) for m in methods if m != VANILLA for b in budgets]
        self.journal = journal
        self.records: dict[tuple[str, int | None, int], dict[str, Any]] = {}
        for record in journal.records if journal is not None else []:
            index = record["index"]
            if index >= len(self.samples) or record["question"] != self.samples[index].question:
                raise ValueError(
                    f"{journal.path}: question {index} differs from this split's; use another --out"
                )
            self.records[record["method"], record["budget"], index] = record
        for cell in dict.fromkeys((method, budget) for method, budget, _ in self.records):
            if cell in self.cells:
                continue
            if cell[0] == VANILLA:  # a resumed run keeps (and finishes) every cell it recorded
                self.cells.insert(0, cell)
            else:
                self.cells.append(cell)
        self.seconds = 0.0

    def run(self, batch_size: int = 8, progress: bool = True) -> None:
        """Answer every question not recorded yet, batch by batch (the same batches on every run)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1; got {batch_size!r}")
        pairs = list(iter_images(self.samples))
        todo = {cell: [i for i in range(len(pairs)) if (*cell, i) not in self.records] for cell in self.cells}
        bar = tqdm(
            total=sum(map(len, todo.values())), desc=f"eval {self.split}", unit="q", disable=not progress
        )
        start = time.perf_counter()
        try:
            for (method, budget), missing in todo.items():
                if not missing:
                    continue
                bar.set_postfix_str(f"{method} K={budget or 'all'}")
                pruning = (
                    contextlib.nullcontext()
                    if method == VANILLA
                    else apply(
                        self.model,
                        method=method,
                        budget=budget,
                        layer=layer_for(method, self.layer),
                        options=self.options,
                        strict=True,
                    )
                )
                with pruning as handle, torch.inference_mode():
                    for first in range(0, len(pairs), batch_size):
                        rows = [i for i in missing if first <= i < first + batch_size]
                        if rows:
                            self._answer(method, budget, rows, [pairs[i] for i in rows], handle)
                            bar.update(len(rows))
        finally:
            bar.close()
            self.seconds += time.perf_counter() - start

    def _answer(self, method: str, budget: int | None, rows: list[int], batch: list, handle) -> None:
        replies = answer(self.model, self.processor, batch)
        visual = _visual_tokens(self.model, len(batch), handle)
        kept = visual if handle is None else (handle.last.kept >= 0).sum(1).tolist()
        for index, (sample, _), reply, k, v in zip(rows, batch, replies, kept, visual, strict=True):
            record = {
                "method": method,
                "budget": budget,
                "index": index,
                "image_id": sample.image_id,
                "kind": sample.kind,
                "question": sample.question,
                "answer": sample.answer,
                "reply": reply,
                "correct": is_correct(sample, reply),
                "kept": int(k),
                "visual": int(v),
            }
            self.records[method, budget, index] = record
            if self.journal is not None:
                self.journal.append(record)

    def report(self) -> Report:
        """The cells of every recorded answer, in split order (cells with none yet are left out)."""
        cells = []
        for method, budget in self.cells:
            cell = Cell(method, budget)
            for index, sample in enumerate(self.samples):
                record = self.records.get((method, budget, index))
                if record is not None:
                    cell.add(sample, record["reply"], record["kept"], record["visual"])
            if cell.total:
                cells.append(cell)
        dtype = str(self.model.dtype).removeprefix("torch.")
        return Report(self.split, self.model_name, self.layer, dtype, cells, self.seconds, len(self.samples))


def layer_for(method: str, layer: int | None) -> int | None:
    """``layer`` for a method that scores one decoder layer; None for one that prunes before the
    language model or on its own schedule (they take no layer)."""
    return layer if get_method(method).where == "layer" else None


def _visual_tokens(model: nn.Module, rows: int, handle) -> list[int]:
    if handle is not None and handle.last is not None:
        return handle.last.n_visual.tolist()
    return [int(model.config.image_seq_length)] * rows
