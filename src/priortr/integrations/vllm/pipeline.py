"""Pipeline parallelism: what a later stage needs of a pruned step, carried beside the hidden states.

vLLM hands the next pipeline stage an ``IntermediateTensors`` of the step's rows (hidden states and
residual); each stage computes the step's positions from the scheduler's output, which for a pruned
prompt's rows are its placeholders' records (``request_records.SlotRecord``), not the kept tokens'
original positions. The scores and the cut are made on the first stage (``config_hooks`` refuses a
scored layer on a later stage), so a pruned step is planned and cut there, and the rows it hands on are
the kept tokens in the request layout vLLM scheduled (a pruned prompt's P rows): a later stage runs its
layers as a stock step does, its attention writing and reading the requests' paged cache, at the
positions the first stage sends with every step's rows (``POSITIONS``). A later stage never embeds the
step, so it never plans one; it needs nothing else.

The runners copy every tensor the model's ``make_empty_intermediate_tensors`` names into buffers of its
shapes and slice them by rows (vLLM 0.32 V1: ``vllm/v1/worker/gpu_model_runner.py:3168-3185``; Model
Runner V2: ``vllm/v1/worker/gpu/model_runner.py:1974-1983``), so the positions travel row-major,
[T, 3] of int64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.distributed import get_pp_group
from vllm.sequence import IntermediateTensors

POSITIONS = "priortr_positions"
"""The intermediate tensor holding each row's position channels [T, 3] (M-RoPE's three; a 1-D RoPE
family's three equal channels, as vLLM's per-request bookkeeping gives them: ``positions.py``)."""
CHANNELS = 3


def empty_tensors(stock: Callable[..., IntermediateTensors]) -> Callable[..., IntermediateTensors]:
    """The model's ``make_empty_intermediate_tensors``: vLLM's (``stock``), plus ``POSITIONS``."""

    def make(batch_size: int, dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
        tensors = stock(batch_size, dtype, device)
        tensors[POSITIONS] = torch.zeros(batch_size, CHANNELS, dtype=torch.long, device=device)
        return tensors

    return make


def received_positions(
    intermediate_tensors: IntermediateTensors | None, positions: torch.Tensor
) -> torch.Tensor:
    """The positions [3, T] a stage runs its layers at: on a later stage, those the previous stage sent
    (the kept tokens' original positions on a pruned prompt's rows); on the first, ``positions``."""
    if get_pp_group().is_first_rank:
        return positions
    if intermediate_tensors is None:
        raise RuntimeError("priortr: a later pipeline stage was called without the previous stage's rows")
    # Contiguous: a 1-D RoPE family's layers take channel 0, which in the transposed rows is a view of
    # stride 3, and vLLM's rotary op reads its positions as contiguous memory (CPU and CUDA alike,
    # ``rotary_embedding/base.py``: ``forward_cpu``, ``forward_cuda``), so every token past the first
    # would be rotated at another token's position wherever custom ops run (eager, or compiled with the
    # eager backend).
    return intermediate_tensors[POSITIONS][: positions.shape[-1]].T.contiguous().to(positions.dtype)


def handed_on(output: Any, positions: torch.Tensor) -> Any:
    """A stage's output: on a stage before the last, vLLM's ``IntermediateTensors`` with the rows'
    positions [3, T] added (``POSITIONS``); on the last stage, the hidden states unchanged."""
    if not isinstance(output, IntermediateTensors):
        return output
    output[POSITIONS] = positions.T.contiguous().to(torch.long)
    return output
