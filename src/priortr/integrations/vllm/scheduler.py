"""The scheduler a pruning model is served with: vLLM's own, holding a pruned prompt to one step.

A pruned request's prefill runs layers 0..L on its whole prompt (text + N tokens per image) outside
the paged cache, from position 0 (``step.py``): every token after an image attends, at
layers 0..L, to the image's N tokens, which no cache holds, and which tokens survive depends on the
prompt's last text rows. Neither a prefix-cache hit nor a chunk boundary inside the prompt can be
served exactly, so a pruned request (its images carry a record, ``request_records.ImageRecord``):

* never reads the prefix cache: the scheduler sets vLLM's own per-request bound when the request
  arrives, so it holds for every admission, a re-prefill after preemption included, and vLLM's hit
  statistics do not count it as a lookup (``keep_off_prefix_cache``);
* is not served in a streaming-input session (a resumable request, vLLM's Python ``AsyncLLM`` input
  streams): a session appends later prompts and images to the request, resets its ``max_tokens`` and,
  in vLLM 0.34, recomputes its prefix-cache bound (``_update_request_as_session``,
  ``vllm/v1/core/sched/scheduler.py:1933-1971`` in 0.34), while the plug-in's records describe one
  prompt. It is finished at once with vLLM's own per-request error (finish reason ``error``), the
  engine and the other requests unharmed, and a warning names the fix;
* is scheduled with its whole prompt in the step that starts its prefill: a chunk that would end
  inside the prompt is not scheduled that step (vLLM's own answer when an image's encoder budget is
  spent), and the prompt waits for a step with room for it. The tokens after the prompt (a
  re-prefill's generated tokens) may follow in later chunks. The processor refuses a pruned prompt
  longer than one step can hold (``config_hooks.step_limit``);
* ends its answer (finish reason ``length``) before its original positions leave the model's: its
  tokens sit at their original positions, ahead of its scheduled tokens by the tokens pruned, and
  vLLM counts ``max_model_len`` on the scheduled tokens, so it would decode past the RoPE table
  (``max_position_embeddings`` rows; on a GPU an index past it is a device-side assert that ends the
  engine). When the request arrives its ``max_tokens`` is lowered to ``settings.position_limit``
  (the larger of ``max_model_len`` and ``max_position_embeddings``) minus its unpruned length, at
  least 1 (the processor refuses an unpruned prompt longer than that limit), which vLLM's
  ``check_stop`` enforces (``vllm/v1/core/sched/utils.py:114-119``). With ``max_model_len`` at its
  default, ``max_position_embeddings`` (``vllm/config/model.py:2545-2683``), the answer ends where the
  unpruned request's would.

Its blocks are still written to the prefix cache. Blocks of text before its first image hold what
any request computes there and serve other requests' hits; a block holding a kept image token is
hashed with the image's identity, which only pruned requests carry, and they never read.
Text-only and unpruned requests are scheduled, cached and chunked as by vLLM.

Two charges follow what a pruned prompt costs, not its K placeholders per image:

* the step's encoder budget is charged N per pruned image the step encodes (the image's embeddings,
  which its processor records, ``request_records.ImageRecord.encoded``), where vLLM charges the
  placeholders' K (``vllm/v1/core/sched/scheduler.py:2076,2198-2199`` in vLLM 0.33): a prompt whose
  images' N do not fit what the step has left waits for a later step, unless it is the step's first
  encoder work (the whole budget left), so that a prompt whose images exceed the budget is
  still served, alone;
* layers 0..L (a multi-stage method: up to its deepest stage, each stage leaving fewer tokens) run
  on the whole prompt S = P + the images' N - K outside the step's token budget (``step.py``): the
  pruned prompts that start in one step hold at most ``max_num_scheduled_tokens``
  (``--max-num-batched-tokens``, the step the engine's memory profile ran) of S together; the
  processor refuses a prompt whose S alone is more (``processor.check_whole_prompt_limit``). A method
  pruning before the language model runs no layer on the whole prompt (``pre_llm.py``): its prompts
  are charged their P scheduled rows only, as vLLM charges them.

vLLM's encoder cache manager is replaced by ``encoder_cache.PrunedEncoderCache``, which counts a pruned
image at the N embeddings the plug-in stores (docs/serving.md, "What a pruned request is charged").
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from priortr.engine.config import BEFORE_LLM
from priortr.integrations.vllm.encoder_cache import PrunedEncoderCache, uncounted
from priortr.integrations.vllm.request_records import recorded_lengths
from priortr.integrations.vllm.settings import position_limit, served_settings
from priortr.integrations.vllm.vision_evidence import evidence_slots

logger = logging.getLogger(__name__)


def keep_off_prefix_cache(request: Any) -> None:
    """Keep a vLLM request from reading the prefix cache, with vLLM's own per-request switch: from vLLM
    0.34 the hit bound ``prefix_cache_hit_limit``, 0 (never read; set in ``Request.__init__``, tested by
    ``KVCacheManager.prefix_cache_lookup_enabled``: ``vllm/v1/request.py:245,364-377``,
    ``vllm/v1/core/kv_cache_manager.py:251-253``), before it ``skip_reading_prefix_cache`` (0.32/0.33,
    the switch prompt logprobs use). Refuses a request that has neither, rather than let it read."""
    if hasattr(request, "prefix_cache_hit_limit"):
        request.prefix_cache_hit_limit = 0
    elif hasattr(request, "skip_reading_prefix_cache"):
        request.skip_reading_prefix_cache = True
    else:
        raise RuntimeError(
            "priortr: this vLLM's requests have neither prefix_cache_hit_limit (0.34) nor "
            "skip_reading_prefix_cache (0.32/0.33), so a pruned prompt cannot be kept off the prefix "
            "cache; install a vLLM the plug-in supports (priortr.integrations.vllm.SUPPORTED_RANGE)"
        )


def pruned(request: Any) -> bool:
    """Whether a vLLM request prunes: its images carry the record the processor writes for pruned
    requests only (``request_records.ImageRecord``)."""
    return recorded_lengths(request.mm_features) is not None


class PruningScheduler(Scheduler):
    """vLLM's scheduler with the rules of the module docstring; built as ``PruningAsyncScheduler``
    when the engine runs vLLM's asynchronous scheduling (resolved after the config hooks run)."""

    def __new__(cls, *args: Any, vllm_config: Any = None, **kwargs: Any) -> Any:
        asynchronous = vllm_config is not None and vllm_config.scheduler_config.async_scheduling
        return super().__new__(PruningAsyncScheduler if cls is PruningScheduler and asynchronous else cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        hf_config = self.vllm_config.model_config.hf_config
        settings = served_settings(hf_config)
        manager = self.encoder_cache_manager
        if type(manager) is EncoderCacheManager:  # vLLM's own (not a configured or encoder-decoder one)
            evidence = None if settings is None else evidence_slots(settings.config, hf_config)
            self.encoder_cache_manager = PrunedEncoderCache(manager.cache_size, evidence)
        self.refused_sessions: set[str] = set()
        self.whole_prompts = settings is None or settings.config.stage_layer != BEFORE_LLM

    whole_prompts = True
    """Whether a pruned prompt runs layers 0..L whole (not for a method pruning before the LLM)."""
    refused_sessions: set[str]
    """The streaming-input sessions whose pruned request was refused, until their end arrives."""
    pruned_tokens = 0
    """S of the pruned prompts started in the step being scheduled (reset by ``schedule``)."""

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self.pruned_tokens = 0
        return super().schedule(*args, **kwargs)

    def add_request(self, request: Any) -> None:
        if pruned(request):
            keep_off_prefix_cache(request)
            unpruned = recorded_lengths(request.mm_features).unpruned
            room = max(position_limit(self.vllm_config.model_config) - unpruned, 1)
            request.max_tokens = min(request.max_tokens, room)
        if (pruned(request) and request.resumable) or request.request_id in self.refused_sessions:
            self._refuse_in_session(request)
        super().add_request(request)

    def _refuse_in_session(self, request: Any) -> None:
        """Finish a pruned request of a streaming-input session, and every later chunk of that session
        (its end included), with vLLM's own per-request failure: FINISHED_ERROR and an output carrying
        finish reason ``error`` at the next update (``vllm/v1/core/sched/scheduler.py:2619-2645`` in 0.34,
        ``:2302-2326`` in 0.32), its images never scheduled before then (``_try_schedule_encoder_inputs``)."""
        if request.request_id not in self.refused_sessions:
            logger.warning(
                "priortr: request %s prunes visual tokens in a streaming-input session, which the plug-in "
                "does not serve (a session appends prompts to a request whose pruned layout is fixed); it "
                "is finished with an error. Send each prompt as its own request, or turn pruning off for "
                'the session\'s requests (mm_processor_kwargs {"priortr": {"enabled": false}})',
                request.request_id,
            )
        if request.resumable:
            self.refused_sessions.add(request.request_id)
        else:  # the session's end
            self.refused_sessions.discard(request.request_id)
        self.encoder_cache_mismatch_reqs.add(request.request_id)

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
        take encoder-cache references, and after it, which may cut the chunk before an image), whose
        images' N exceed the encoder budget left, or whose whole prompt S would take the step's pruned
        prompts past the step (module docstring)."""
        nothing = ([], 0, encoder_compute_budget, [], [])
        if request.request_id in self.encoder_cache_mismatch_reqs:
            return nothing
        if self._splits_prompt(request, num_computed_tokens, num_new_tokens):
            return nothing
        starts = num_computed_tokens == 0 and pruned(request)
        whole = request.num_prompt_tokens + uncounted(request) if starts and self.whole_prompts else 0  # S
        if starts and self.pruned_tokens + whole > self.max_num_scheduled_tokens:
            return nothing
        chosen = super()._try_schedule_encoder_inputs(
            request, num_computed_tokens, num_new_tokens, encoder_compute_budget, shift_computed_tokens
        )
        if self._splits_prompt(request, num_computed_tokens, chosen[1]):
            return nothing
        left = chosen[2] - uncounted(request, chosen[0])
        if left < 0 and encoder_compute_budget < self.max_num_encoder_input_tokens:
            return nothing
        if chosen[1]:
            self.pruned_tokens += whole
        return (chosen[0], chosen[1], max(left, 0), chosen[3], chosen[4])

    @staticmethod
    def _splits_prompt(request: Any, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Whether scheduling ``num_new_tokens`` after ``num_computed_tokens`` ends a pruned
        request's chunk inside its prompt."""
        return 0 < num_computed_tokens + num_new_tokens < request.num_prompt_tokens and pruned(request)


class PruningAsyncScheduler(PruningScheduler, AsyncScheduler):
    """``PruningScheduler`` over vLLM's asynchronous scheduler."""
