"""Steps padded as vLLM's GPU runners pad them, served exactly (issue 46, item 1).

With CUDA graphs a mixed step is padded to a captured size: vLLM's V1 runner embeds the scheduled
ids and hands the model its input buffer cut to the padded size (``vllm/v1/worker/gpu_model_runner.py``
:3320-3331, the size from ``_determine_batch_execution_and_padding``, :3684 and :4018 in vLLM 0.33),
and Model Runner V2 does the same (``vllm/v1/worker/gpu/model_states/default.py:104-130``). The CPU
build never pads, so each test here patches the CPU runner's one padding decision (it inherits the V1
runner's ``execute_model``): every step is padded past its tokens to the next multiple of ``PAD``, the
way a piecewise graph's size is chosen (attention metadata unpadded, the padded rows' positions stale or
zero, vLLM's ``is_padding`` mask set). Stock requests stay exact under the patch, which validates the
emulation; then every family's pruned requests, arriving while others decode, must stay exact too.
Model Runner V2 cannot run on the CPU build (``test_model_runner_v2.py``); its model call is the same
contract (unpadded ids embedded, a longer buffer handed in), which the V1 path checks here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
from vllm import LLM, SamplingParams
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from priortr.integrations.vllm import models
from tests.vllm.checkpoints import MISTRAL3_TOKEN_PIXELS
from tests.vllm.harness import ANSWER_TOKENS, apply_settings, run_arrivals
from tests.vllm.reference import ENGINE, LLAVA_PROMPT, QWEN_IMAGE, hf_tokens, image, vllm_request

PAD = 8
REQUEST_BUDGETS = [2]
"""The budgets this module's requests ask for, which the engine grants (its ``request_budgets``)."""
TEXT_ONLY = "USER: what is the color of the cat ASSISTANT:"


@dataclass(frozen=True)
class Family:
    """A served family as these tests drive it: its checkpoint fixture, engine settings, a prompt with
    one image, and two image sizes (``small``, ``large``: seed -> image)."""

    fixture: str
    settings: dict
    one: str
    small: Any
    large: Any
    limits: dict


def _mistral3(rows: int, cols: int) -> Any:
    return lambda seed: image(cols * MISTRAL3_TOKEN_PIXELS, seed, height=rows * MISTRAL3_TOKEN_PIXELS)


FAMILIES = {
    "llava": Family(
        "llava_dir",
        {"method": "priortr", "budget": 4, "layer": 1},
        LLAVA_PROMPT.format("what is in the image"),
        lambda seed: image(28, seed),
        lambda seed: image(28, seed),
        {"image": 1},
    ),
    "llava-next": Family(
        "llava_next_dir",
        {"method": "priortr", "budget": 8, "layer": 1},
        "USER: <image> what is in the image ASSISTANT:",
        lambda seed: image(28, seed),
        lambda seed: image(56, seed, height=28),
        {"image": 1},
    ),
    "internvl": Family(
        "internvl_dir",
        {"method": "priortr", "budget": 8, "layer": 1},
        "USER: <IMG_CONTEXT> what is in the image ASSISTANT:",
        lambda seed: image(56, seed),
        lambda seed: image(112, seed, height=56),
        {"image": 1, "video": 0},
    ),
    "mistral3": Family(
        "mistral3_dir",
        {"method": "priortr", "budget": 4, "layer": 1},
        "USER: [IMG] what is in the image ASSISTANT:",
        _mistral3(2, 3),
        _mistral3(4, 4),
        {"image": 1},
    ),
    "qwen2-vl": Family(
        "qwen_dir",
        {"method": "fastv", "budget": 6, "layer": 1},
        f"USER: {QWEN_IMAGE} what is in the image ASSISTANT:",
        lambda seed: image(56, seed),
        lambda seed: image(112, seed),
        {"image": 1, "video": 0},
    ),
    "qwen3-vl": Family(
        "qwen3_vl_dir",
        {"method": "fastv", "budget": 6, "layer": 1},
        f"USER: {QWEN_IMAGE} what is in the image ASSISTANT:",
        lambda seed: image(64, seed),
        lambda seed: image(128, seed),
        {"image": 1, "video": 0},
    ),
}
"""1-D RoPE (LLaVA, LLaVA-NeXT's AnyRes, InternVL's tiles, Mistral 3's row breaks) and M-RoPE (Qwen2-VL,
Qwen3-VL with DeepStack)."""


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request: pytest.FixtureRequest) -> tuple[Family, Any, LLM]:
    """(family, checkpoint, engine)."""
    family = FAMILIES[request.param]
    path = request.getfixturevalue(family.fixture)
    engine = LLM(
        model=str(path),
        hf_overrides={"priortr": {**family.settings, "request_budgets": REQUEST_BUDGETS}},
        limit_mm_per_prompt=family.limits,
        **ENGINE,
    )
    yield family, path, engine
    del engine


@pytest.fixture
def padded_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Pad every step of the engine's runner past its tokens to the next multiple of ``PAD`` (within the
    runner's buffers); the (tokens, padded size) of each step, as it runs."""
    stock = GPUModelRunner._determine_batch_execution_and_padding
    steps: list[tuple[int, int]] = []

    def padded(self: Any, num_tokens: int, *args: Any, **kwargs: Any) -> tuple:
        mode, descriptor, *rest = stock(self, num_tokens, *args, **kwargs)
        size = min(num_tokens // PAD * PAD + PAD, self.max_num_tokens)
        steps.append((num_tokens, size))
        return (mode, replace(descriptor, num_tokens=size), *rest)

    monkeypatch.setattr(GPUModelRunner, "_determine_batch_execution_and_padding", padded)
    return steps


@pytest.fixture
def pruned_steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(tokens embedded, rows handed in) of every step that runs a pruned prefill."""
    stock = models.PruningModel._pruned_forward
    seen: list[tuple[int, int]] = []

    def recording(self: Any, step: Any, positions: Any, inputs_embeds: Any) -> Any:
        seen.append((len(step.input_ids), inputs_embeds.shape[0]))
        out = stock(self, step, positions, inputs_embeds)
        assert out.shape[0] == inputs_embeds.shape[0]  # the hidden states keep the padded length
        return out

    monkeypatch.setattr(models.PruningModel, "_pruned_forward", recording)
    return seen


def expected(family: Family, path: Any, case: tuple) -> list[int]:
    prompt, images, budget = case
    return hf_tokens(path, prompt, images, apply_settings(family.settings, images, budget), ANSWER_TOKENS)


def serve(llm: LLM, cases: dict[int, tuple], arrivals: dict[int, list[int]]) -> dict[int, list[int]]:
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
    requests = {name: vllm_request(*case) for name, case in cases.items()}
    return run_arrivals(llm.llm_engine, requests, arrivals, params)


def test_stock_requests_stay_exact_when_padded(served, padded_steps, pruned_steps):
    """The emulation's check: unpruned and text-only requests (vLLM's own forward) answer as HF does
    with every step padded."""
    family, path, llm = served
    off = {"enabled": False}
    cases = {
        0: (family.one, [family.large(0)], off),
        1: (TEXT_ONLY, [], None),
        2: (family.one, [family.small(1)], off),
    }
    results = serve(llm, cases, {0: [0], 2: [1, 2]})
    assert any(size > tokens for tokens, size in padded_steps)
    assert not pruned_steps
    for name, case in cases.items():
        assert results[name] == expected(family, path, case), name


def test_pruned_requests_stay_exact_when_padded(served, padded_steps, pruned_steps):
    """Pruned prefills beside decodes, text-only and unpruned prompts, in padded steps."""
    family, path, llm = served
    cases = {
        0: (family.one, [family.large(10)], None),
        1: (family.one, [family.small(11)], None),
        2: (TEXT_ONLY, [], None),
        3: (family.one, [family.large(12)], {"enabled": False}),
        4: (family.one, [family.large(13)], {"budget": 2}),
    }
    results = serve(llm, cases, {0: [0], 2: [1, 2, 3], 5: [4]})
    assert len(pruned_steps) >= 2  # requests 0 and 4; 1 keeps all of a 4-token Qwen image
    assert all(rows > tokens for tokens, rows in pruned_steps)
    for name, case in cases.items():
        assert results[name] == expected(family, path, case), name
