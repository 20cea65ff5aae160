"""Model Runner V2's input preparation after a preemption, driven through the plug-in.

vLLM's CPU build cannot run Model Runner V2 (it needs a Triton with a CPU backend, which PyPI's
``triton`` lacks), so this drives V2's own code for the step that matters: its scheduler re-adds a
preempted request as a new one whose prefill tokens are prompt + generated tokens
(``NewRequestData.from_request(req, ..., req._all_token_ids)``), and ``RopeState.init_prefill_positions``
asks the model for that request's positions. The planned prompt (the tokens and positions the scores
are computed from) must equal what the V1 runner plans from the positions it kept from the prompt.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.request import Request
from vllm.v1.worker.gpu.mm.rope import RopeState

from priortr.integrations.vllm import models
from priortr.integrations.vllm.prefill_step import PrunedPrompt, StepImage, StepInputs, plan_step
from priortr.integrations.vllm.request_layout import RequestLengths
from tests.vllm.reference import ENGINE, LLAVA_PROMPT, QWEN_IMAGE, image

SETTINGS = {"method": "fastv", "budget": 6, "layer": 1}
GENERATED = 7
CASES = {
    "qwen_dir": (
        f"USER: {QWEN_IMAGE} a {QWEN_IMAGE} what is in the image ASSISTANT:",
        [image(112, 20), image(56, 30)],
    ),
    "llava_dir": (LLAVA_PROMPT.format("what is in the image"), [image(28, 0)]),
}


class StagedRows:
    """Stands in for V2's staged (pinned, device) position buffer: keeps the rows written to it."""

    def __init__(self) -> None:
        self.rows: dict[int, list[int]] = {}

    def stage_write(self, row: int, start: int, values: list[int]) -> None:
        assert start == 0
        self.rows[row] = values


@pytest.fixture(scope="module", params=list(CASES), ids=["qwen2-vl", "llava"])
def first_add(request):
    """(model, prompt, mm_features, V1 positions [3, P], delta, generated tokens) of one pruned
    request (Qwen2-VL with two images, M-RoPE; LLaVA with one, 1-D RoPE through vLLM's M-RoPE
    bookkeeping), as the V1 runner asked for them when the request arrived."""
    text, images = CASES[request.param]
    engine = LLM(
        model=str(request.getfixturevalue(request.param)),
        hf_overrides={"priortr": SETTINGS},
        limit_mm_per_prompt={"image": 2, "video": 0},
        **ENGINE,
    )
    model = engine.apply_model(lambda model: model)[0]
    calls = []
    stock = model.get_mrope_input_positions

    def recording(tokens, features):
        out = stock(tokens, features)
        calls.append((list(tokens), features, *out))
        return out

    model.get_mrope_input_positions = recording
    params = SamplingParams(max_tokens=GENERATED, temperature=0.0, ignore_eos=True)
    data = {"image": images if len(images) > 1 else images[0]}
    out = engine.generate([{"prompt": text, "multi_modal_data": data}], params, use_tqdm=False)[0]
    del model.get_mrope_input_positions
    ((prompt, features, positions, delta),) = calls
    assert prompt == list(out.prompt_token_ids)
    yield model, prompt, features, positions, delta, list(out.outputs[0].token_ids)
    del engine


def v2_readd(model, prompt: list[int], features: list, generated: list[int]) -> tuple[torch.Tensor, int]:
    """[3, P + G] positions and delta that V2 stages for the request re-added after a preemption."""
    request = Request("r", prompt, SamplingParams(max_tokens=GENERATED), None, mm_features=features)
    request.append_output_token_ids(generated)
    assert request.num_computed_tokens == 0
    new = NewRequestData.from_request(request, ([],), request._all_token_ids, uses_mrope=True)
    assert new.prefill_token_ids == prompt + generated
    buffers = SimpleNamespace(
        num_dims=3, prefill_delta=SimpleNamespace(np=np.zeros(1)), prefill_positions=StagedRows()
    )
    RopeState.init_prefill_positions(buffers, 0, model, new.prefill_token_ids, new.mm_features)
    rows = buffers.prefill_positions.rows
    return torch.tensor([rows[0], rows[1], rows[2]]), int(buffers.prefill_delta.np[0])


def planned(model, tokens: list[int], positions: torch.Tensor, features: list) -> PrunedPrompt:
    """The plug-in's plan of a re-prefill step that holds ``tokens`` (prompt + generated) alone."""
    width = model._hf_config.get_text_config().hidden_size
    images = [
        StepImage(f.mm_position.offset, f.mm_position.length, torch.zeros(model._slots(f).tokens, width))
        for f in features
    ]
    step = StepInputs(tokens, images)
    (prompt,) = plan_step(
        step, positions.tolist(), [0, len(tokens)], [len(tokens)], model._image_token, model.layout
    )
    return prompt


def same_plan(a: PrunedPrompt, b: PrunedPrompt) -> bool:
    return (
        a.length == b.length
        and a.token_ids == b.token_ids
        and torch.equal(a.positions, b.positions)
        and torch.equal(a.text_columns, b.text_columns)
        and torch.equal(a.text_rows, b.text_rows)
        and a.counts == b.counts
    )


def v1_readd(positions: torch.Tensor, delta: int, generated: list[int]) -> torch.Tensor:
    """What the V1 runner's re-prefill sees: the prompt's kept positions, then delta + index."""
    start = positions.shape[1]
    tail = torch.arange(start, start + len(generated), dtype=positions.dtype) + delta
    return torch.cat([positions, tail.expand(3, -1)], dim=1)


def test_readded_request_plans_the_original_prompt(first_add):
    model, prompt, features, positions, delta, generated = first_add
    assert any(f.mm_position.length < model._slots(f).tokens for f in features), "nothing was pruned"
    v2_positions, v2_delta = v2_readd(model, prompt, features, generated)
    assert v2_delta == delta
    tokens = prompt + generated
    v1 = planned(model, tokens, v1_readd(positions, delta, generated), features)
    v2 = planned(model, tokens, v2_positions, features)
    assert v1.length == len(prompt)
    assert same_plan(v2, v1)
    assert torch.equal(v2_positions, v1_readd(positions, delta, generated))


def test_length_from_the_tokens_is_caught(first_add, monkeypatch):
    """Negative control: the prompt length taken from the tokens handed in (the defect) plans the
    generated tokens as instruction, and the comparison above then fails."""
    model, prompt, features, positions, delta, generated = first_add
    tokens = prompt + generated
    recorded = models.recorded_lengths(features)
    monkeypatch.setattr(
        models, "recorded_lengths", lambda features: RequestLengths(len(tokens), recorded.unpruned)
    )
    v2_positions, _ = v2_readd(model, prompt, features, generated)
    v1 = planned(model, tokens, v1_readd(positions, delta, generated), features)
    v2 = planned(model, tokens, v2_positions, features)
    assert v2.length == len(tokens)
    assert not same_plan(v2, v1)


def test_request_without_a_recorded_length_is_refused(first_add, monkeypatch):
    model, prompt, features, _, _, generated = first_add
    monkeypatch.setattr(models, "recorded_lengths", lambda features: None)
    with pytest.raises(RuntimeError, match="prompt length"):
        v2_readd(model, prompt, features, generated)
