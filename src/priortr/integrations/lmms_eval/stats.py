"""What the plug-in reports per request type: visual tokens kept, model time and generated tokens, summed
over the processes of a data-parallel run, written to lmms-eval's results and the log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lmms_eval.models.model_utils.gen_metrics import log_metrics
from loguru import logger as eval_logger


@dataclass
class KeptStats:
    """Visual tokens kept over the batches of one request type: requests with images, and without;
    model time and generated tokens of those batches."""

    rows: int = 0
    kept: int = 0  # summed over rows
    total: int = 0  # summed over rows
    unpruned_rows: int = 0  # rows without an image: nothing to prune
    gen_tokens: int = 0
    elapsed: float = 0.0  # seconds in the model's forward / generate calls

    def add(self, rows: int, pruned_rows: int, kept: int, total: int) -> None:
        """A batch of ``rows`` requests, ``pruned_rows`` of them with images, keeping ``kept`` of their
        ``total`` visual tokens."""
        self.unpruned_rows += rows - pruned_rows
        self.rows += pruned_rows
        self.kept += kept
        self.total += total

    @property
    def requests(self) -> int:
        return self.rows + self.unpruned_rows

    def summed_over_processes(self, accelerator: Any, device: torch.device) -> KeptStats:
        """These counts summed over every process of a data-parallel run (a collective call: every
        process must make it). float64 holds the integer counts exactly."""
        counts = [self.rows, self.kept, self.total, self.unpruned_rows, self.gen_tokens, self.elapsed]
        summed = accelerator.reduce(torch.tensor(counts, dtype=torch.float64, device=device), reduction="sum")
        rows, kept, total, unpruned, gen_tokens, elapsed = summed.tolist()
        return KeptStats(int(rows), int(kept), int(total), int(unpruned), int(gen_tokens), elapsed)

    def summary(self) -> dict[str, float]:
        if self.rows == 0:
            return {}
        return {
            "kept_tokens": self.kept / self.rows,
            "visual_tokens": self.total / self.rows,
            "kept_ratio": self.kept / self.total,
        }


def report_stats(kind: str, stats: KeptStats, budget: int | float) -> None:
    """Log the statistics of one request type to lmms-eval's results (``log_metrics``) and the log."""
    extra: dict[str, Any] = {
        "budget": budget,
        **stats.summary(),
        "unpruned_requests": stats.unpruned_rows,
    }
    speed = stats.gen_tokens / stats.elapsed if stats.elapsed > 0 else 0.0
    log_metrics(stats.elapsed, stats.gen_tokens, speed, extra)
    if stats.rows:
        eval_logger.info(
            f"priortr {kind}: kept {stats.kept / stats.rows:.2f} of {stats.total / stats.rows:.2f} "
            f"visual tokens per request on average ({stats.rows} requests with an image, "
            f"{stats.unpruned_rows} without: unpruned)"
        )
    elif stats.unpruned_rows:
        eval_logger.info(f"priortr {kind}: {stats.unpruned_rows} requests ran unpruned (no image)")
