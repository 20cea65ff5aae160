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
[T, 3] of int64; a later stage copies them into a [3, T] buffer of its own (``sent_rows``), laid out
as vLLM lays out its positions.
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


def sent_rows(vllm_config: Any) -> torch.Tensor | None:
    """A later stage's buffer for the positions the previous stage sends, [3, M] int64 on the stage's
    device (M: ``max_num_batched_tokens``, the most rows a step holds, as vLLM sizes its own positions
    buffers); None on the first stage, which computes its own. One buffer for every step, so that the
    stage's layers see the sent positions as they see vLLM's own: each channel a contiguous row (vLLM's
    rotary op reads its positions as contiguous memory, CPU and CUDA alike: ``rotary_embedding/base.py``,
    ``forward_cpu``, ``forward_cuda``) at one address every step (a CUDA graph replays the addresses it
    captured, ``vllm/compilation/cuda_graph.py:343-357``: vLLM keeps a later stage's inputs in
    persistent buffers for it, Model Runner V2: ``vllm/v1/worker/gpu/model_runner.py:2094-2104``,
    ``cudagraph_utils.py:749-761``, vLLM 0.34)."""
    if get_pp_group().is_first_rank:
        return None
    rows = vllm_config.scheduler_config.max_num_batched_tokens
    return torch.zeros(CHANNELS, rows, dtype=torch.long, device=vllm_config.device_config.device)


def received_positions(
    intermediate_tensors: IntermediateTensors | None, positions: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """The positions [3, T] a stage runs its layers at: on a later stage, those the previous stage sent
    (the kept tokens' original positions on a pruned prompt's rows), copied into the stage's buffer
    ``rows`` (``sent_rows``); on the first (``rows`` None), ``positions``. A transposed view of the sent
    rows instead would hand a 1-D RoPE family's layers channel 0 at stride 3, which vLLM's rotary op
    reads as other tokens' positions (LLaVA over two stages answered wrong on every request, text-only
    ones too, wherever vLLM's custom ops run: eager, or compiled on the eager backend)."""
    if rows is None:
        return positions
    if intermediate_tensors is None:
        raise RuntimeError("priortr: a later pipeline stage was called without the previous stage's rows")
    count = positions.shape[-1]
    if count > rows.shape[1]:
        raise RuntimeError(
            f"priortr: a step of {count} rows on a later pipeline stage, past max_num_batched_tokens "
            f"({rows.shape[1]}), which sizes the stage's buffer of sent positions"
        )
    stage = rows[:, :count]
    stage.copy_(intermediate_tensors[POSITIONS][:count].T)
    return stage


def handed_on(output: Any, positions: torch.Tensor) -> Any:
    """A stage's output: on a stage before the last, vLLM's ``IntermediateTensors`` with the rows'
    positions [3, T] added (``POSITIONS``); on the last stage, the hidden states unchanged."""
    if not isinstance(output, IntermediateTensors):
        return output
    output[POSITIONS] = positions.T.contiguous().to(torch.long)
    return output
