"""Where Model Runner V2 and V1 differ for the plug-in: a pruned request re-added after a preemption.

V1 asks the model for a request's positions once, when the request arrives (its prompt alone), and keeps
them. V2 re-adds a preempted request as a new one whose prefill tokens are its prompt and the tokens it
generated (``NewRequestData.from_request(req, ..., req._all_token_ids)``, ``vllm/v1/core/sched/output.py``)
and asks for positions again (``RopeState.init_prefill_positions``, ``vllm/v1/worker/gpu/mm/rope.py``): the
plug-in must then end the prompt where its processor recorded it, not at the tokens handed in
(``positions.request_positions``). The negative control plants that defect: it changes the answers under
V2 and not under V1, which is what shows that V2 really re-asks (and that the run's runner is the one it
claims, beside ``conftest.py``'s check).
"""

from __future__ import annotations

import pytest
import torch

from priortr.integrations.vllm import models
from priortr.integrations.vllm.positions import ImageSlots, linear_positions, request_positions
from tests.vllm.family_contract import FAMILIES, PREEMPTED_TOKENS, answers, expected, preemption_engine
from tests.vllm.harness import generate
from tests.vllm.runners import RUNNER


@pytest.mark.parametrize("family", ["llava", "qwen2-vl"])
def test_prompt_length_from_the_tokens_changes_answers_under_v2_only(family, request, monkeypatch):
    """Four two-image prompts preempted by a 3-block cache (``family_contract.preemption_engine``), the
    prompt length taken from the tokens handed in: V2's re-prefill then scores the generated tokens as
    instruction rows, and some answer differs from ``priortr.apply``'s; under V1 none does."""
    row = FAMILIES[family]
    path = request.getfixturevalue(row.fixture)
    stock = models.request_positions

    def length_from_the_tokens(prompt, images, token_id, full, prompt_length):
        return stock(prompt, images, token_id, full, None if prompt_length is None else len(prompt))

    monkeypatch.setattr(models, "request_positions", length_from_the_tokens)
    engine = preemption_engine(row, path, step_tokens=96)
    cases = [(row.two, [row.small(20 + i), row.small(30 + i)], None) for i in range(4)]
    outs = generate(engine, cases, tokens=PREEMPTED_TOKENS)
    preempted = [m for m in engine.llm_engine.get_metrics() if m.name == "vllm:num_preemptions"]
    del engine
    assert preempted and preempted[0].value > 0, "nothing was preempted"
    exact = [
        answer == expected(row, path, case, PREEMPTED_TOKENS)
        for case, answer in zip(cases, answers(outs), strict=True)
    ]
    if RUNNER == "v2":
        assert not all(exact), "V2 re-asked no positions after the preemption, or the defect is harmless"
    else:
        assert all(exact), "V1 asked for positions again after the preemption"


def test_request_without_a_recorded_length_is_refused():
    """A pruned request whose images carry no recorded prompt length (a record lost on the way) is
    refused, not planned from the tokens handed in."""
    image = ImageSlots(offset=2, kept_count=4, tokens=16, grid=(4, 4))
    prompt = [1, 2, *[9] * 4, 3, 4]

    def full(tokens: list[int], starts: list[int]) -> tuple[torch.Tensor, int]:
        return linear_positions(tokens, starts)

    with pytest.raises(RuntimeError, match="prompt length"):
        request_positions(prompt, [image], 9, full, None)
    positions, _ = request_positions(prompt, [image], 9, full, len(prompt))  # negative control
    assert positions.shape == (3, len(prompt))
