"""Driving a vLLM engine the way the plug-in's tests need: requests arriving while others decode, and
the faults the negative controls patch into the plug-in (each must change the answer)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, TypeVar

from priortr.integrations.vllm import models, positions

Name = TypeVar("Name", bound=Hashable)


def run_arrivals(
    engine: Any, requests: Mapping[Name, dict], arrivals: Mapping[int, list[Name]], params: Any
) -> dict[Name, list[int]]:
    """Step ``engine`` (vLLM's ``LLMEngine``) until every request has finished, adding the requests
    that ``arrivals`` names for a step before that step; each request's generated tokens by name."""
    names = {str(name): name for name in requests}
    results: dict[Name, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for name in arrivals.get(step, []):
            engine.add_request(str(name), requests[name], params)
        for output in engine.step():
            if output.finished:
                results[names[output.request_id]] = list(output.outputs[0].token_ids)
        step += 1
    return results


def shift_decode_offset(monkeypatch: Any) -> None:
    """Fault: every request decodes one position off its original positions."""

    def shifted(*args: Any, **kwargs: Any) -> tuple:
        found, delta = positions.request_positions(*args, **kwargs)
        return found, delta + 1

    monkeypatch.setattr(models, "request_positions", shifted)


def skip_kv_rewrite(monkeypatch: Any) -> None:
    """Fault: the paged cache of layers 0..L holds zeros where the kept tokens' keys and values belong."""
    original = models.prefill_prompt

    def without_rewrite(*args: Any, **kwargs: Any) -> Any:
        kept = original(*args, **kwargs)
        return kept.__class__(
            keys=[k.zero_() for k in kept.keys],
            values=[v.zero_() for v in kept.values],
            hidden=kept.hidden,
            residual=kept.residual,
            positions=kept.positions,
        )

    monkeypatch.setattr(models, "prefill_prompt", without_rewrite)
