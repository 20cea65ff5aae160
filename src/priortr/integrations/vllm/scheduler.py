"""The scheduler a pruning model is served with: vLLM's own, holding a pruned prompt to one step.

A pruned request's prefill runs layers 0..L on its whole prompt (text + N tokens per image) outside
the paged cache, from position 0 (``prefill_step.py``): every token after an image attends, at
layers 0..L, to the image's N tokens, which no cache holds, and which tokens survive depends on the
prompt's last text rows. Neither a prefix-cache hit nor a chunk boundary inside the prompt can be
served exactly, so a pruned request (its images carry the recorded prompt length, ``processor.py``):

* never reads the prefix cache: the scheduler sets vLLM's own per-request switch
  ``skip_reading_prefix_cache`` (the one prompt logprobs use) when the request arrives, so it holds
  for every admission, a re-prefill after preemption included, and vLLM's hit statistics do not
  count it as a lookup;
* is scheduled with its whole prompt in the step that starts its prefill: a chunk that would end
  inside the prompt is not scheduled that step (vLLM's own answer when an image's encoder budget is
  spent), and the prompt waits for a step with room for it. The tokens after the prompt (a
  re-prefill's generated tokens) may follow in later chunks. The processor refuses a pruned prompt
  longer than one step can hold (``config_hooks.step_limit``);
* ends its answer (finish reason ``length``) before its original positions leave the model's: its
  tokens sit at their original positions, ahead of its scheduled tokens by the tokens pruned, and
  vLLM counts ``max_model_len`` on the scheduled tokens, so it would decode past the RoPE table
  (``max_position_embeddings`` rows; on a GPU an index past it is a device-side assert that ends the
  engine). When the request arrives its ``max_tokens`` is lowered to ``processor.position_limit``
  (the larger of ``max_model_len`` and ``max_position_embeddings``) minus its unpruned length, at
  least 1 (the processor refuses an unpruned prompt longer than that limit), which vLLM's
  ``check_stop`` enforces (``vllm/v1/core/sched/utils.py:114-119``). With ``max_model_len`` at its
  default, ``max_position_embeddings`` (``vllm/config/model.py:2545-2683``), the answer ends where the
  unpruned request's would.

Its blocks are still written to the prefix cache. Blocks of text before its first image hold what
any request computes there and serve other requests' hits; a block holding a kept image token is
hashed with the image's identity, which only pruned requests carry, and they never read.
Text-only and unpruned requests are scheduled, cached and chunked as by vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from priortr.integrations.vllm.processor import PROMPT_LENGTH_KEY, UNPRUNED_LENGTH_KEY, position_limit


def pruned(request: Any) -> bool:
    """Whether a vLLM request prunes: one of its images carries the prompt length the processor
    records for pruned requests only."""
    return any(
        feature.modality == "image" and feature.data is not None and PROMPT_LENGTH_KEY in feature.data
        for feature in request.mm_features
    )


def unpruned_length(request: Any) -> int:
    """A pruned request's prompt length with every image whole, as the processor recorded it."""
    (length,) = {
        int(feature.data[UNPRUNED_LENGTH_KEY].data)
        for feature in request.mm_features
        if feature.modality == "image" and feature.data is not None and UNPRUNED_LENGTH_KEY in feature.data
    }
    return length


class PruningScheduler(Scheduler):
    """vLLM's scheduler with the rules of the module docstring; built as ``PruningAsyncScheduler``
    when the engine runs vLLM's asynchronous scheduling (resolved after the config hooks run)."""

    def __new__(cls, *args: Any, vllm_config: Any = None, **kwargs: Any) -> Any:
        asynchronous = vllm_config is not None and vllm_config.scheduler_config.async_scheduling
        return super().__new__(PruningAsyncScheduler if cls is PruningScheduler and asynchronous else cls)

    def add_request(self, request: Any) -> None:
        if pruned(request):
            request.skip_reading_prefix_cache = True
            room = max(position_limit(self.vllm_config.model_config) - unpruned_length(request), 1)
            request.max_tokens = min(request.max_tokens, room)
        super().add_request(request)

    def _try_schedule_encoder_inputs(
        self,
        request: Any,
        num_computed_tokens: int,
        num_new_tokens: int,
        encoder_compute_budget: int,
        shift_computed_tokens: int = 0,
    ) -> tuple[list[int], int, int, list[int], list[int]]:
        """vLLM's choice of the step's encoder inputs and tokens, or nothing this step for a pruned
        request whose chunk would end inside its prompt (checked before vLLM's choice, which may
        take encoder-cache references, and after it, which may cut the chunk before an image)."""
        nothing = ([], 0, encoder_compute_budget, [], [])
        if self._splits_prompt(request, num_computed_tokens, num_new_tokens):
            return nothing
        chosen = super()._try_schedule_encoder_inputs(
            request, num_computed_tokens, num_new_tokens, encoder_compute_budget, shift_computed_tokens
        )
        if self._splits_prompt(request, num_computed_tokens, chosen[1]):
            return nothing
        return chosen

    @staticmethod
    def _splits_prompt(request: Any, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Whether scheduling ``num_new_tokens`` after ``num_computed_tokens`` ends a pruned
        request's chunk inside its prompt."""
        return 0 < num_computed_tokens + num_new_tokens < request.num_prompt_tokens and pruned(request)


class PruningAsyncScheduler(PruningScheduler, AsyncScheduler):
    """``PruningScheduler`` over vLLM's asynchronous scheduler."""
