"""priortr inside vLLM: visual tokens pruned after decoder layer L of a served model (docs/serving.md).

``register`` is vLLM's ``vllm.general_plugins`` entry point, run in every vLLM process: it puts the
pruning model classes in place of vLLM's LLaVA-1.5, Qwen2-VL and Qwen2.5-VL classes (each behaves as
the stock class unless the model config carries ``priortr`` settings), with their processors and
their config hooks.
"""

from __future__ import annotations


def register() -> None:
    """Register the pruning model classes, processors and config hooks with vLLM."""
    from priortr.integrations.vllm.registration import register_all

    register_all()
