"""The one clock of the front ends and tools: named time marks, and the wall time of a model's forward calls.

On a GPU the marks are CUDA events, recorded in the stream without synchronising inside the measured
region (read once, at the end); on the CPU, where kernels run synchronously, a monotonic clock.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class Clock:
    """Named time marks on ``device``; a name keeps its first mark."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        if name in self.marks:
            return
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def elapsed_ms(self, start: str, end: str) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return self.marks[start].elapsed_time(self.marks[end])
        return (self.marks[end] - self.marks[start]) * 1e3


@contextmanager
def forward_calls_ms(model: nn.Module) -> Iterator[list[float]]:
    """Within the block, time every forward call of ``model``; the list holds each call's milliseconds,
    in order, once the block ends (in ``generate()``: the prefill first, then each decode step). Hooks on
    the top-level model see the whole call (vision tower, pruned decoder, LM head)."""
    clock = Clock(model.device)
    calls = [0, 0]

    def on_call(*_: Any) -> None:
        clock.mark(f"call {calls[0]}")
        calls[0] += 1

    def on_return(*_: Any) -> None:
        clock.mark(f"return {calls[1]}")
        calls[1] += 1

    handles = [model.register_forward_pre_hook(on_call), model.register_forward_hook(on_return)]
    durations: list[float] = []
    try:
        yield durations
    finally:
        for handle in handles:
            handle.remove()
        durations += [clock.elapsed_ms(f"call {i}", f"return {i}") for i in range(calls[1])]


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The median time of ``fn()`` over ``repeats`` calls on ``device``, after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        clock = Clock(device)
        clock.mark("start")
        fn()
        clock.mark("end")
        samples.append(clock.elapsed_ms("start", "end") / 1e3)
    return statistics.median(samples)
