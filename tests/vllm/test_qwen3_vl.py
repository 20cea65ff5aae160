"""Qwen3-VL, dense and MoE (q/k norms, interleaved M-RoPE, DeepStack; the MoE's decoder layers 1-3 with
vLLM's sparse MoE blocks) served by vLLM with the plug-in, against priortr.apply + HF generate().

Each tiny checkpoint adds DeepStack features to the outputs of decoder layers 0 and 1, and the engine
scores layer 1: the last injection lands on every visual token before the cut, as in ``apply``; the
MoE's scored layer 1 is a MoE layer, run on the pruned prompt whole and on the step's other rows. One
engine per family serves the module; negative controls drop the DeepStack features of the pruned
prompt, and of the unpruned rows of a pruned step, decode one position off, or leave the kept keys and
values out of the paged cache, and the answers must then differ.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from vllm import LLM, SamplingParams
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock

from priortr.integrations.vllm import models
from tests.vllm.harness import (
    ANSWER_TOKENS,
    apply_settings,
    generate,
    run_arrivals,
    shift_decode_offset,
    skip_kv_rewrite,
)
from tests.vllm.reference import ENGINE, QWEN_IMAGE, hf_tokens, image, vllm_request

SETTINGS = {"method": "fastv", "budget": 6, "layer": 1}
REQUEST_BUDGETS = [10, 4, 2]
"""The budgets this module's requests ask for, which the engine grants (its ``request_budgets``)."""
TOKENS = ANSWER_TOKENS
ONE = f"USER: {QWEN_IMAGE} what is in the image ASSISTANT:"
TWO = f"USER: {QWEN_IMAGE} a {QWEN_IMAGE} what is in the image ASSISTANT:"
TEXT_ONLY = "USER: what is the color of the cat ASSISTANT:"
FAMILIES = {"qwen3_vl": models.PruningQwen3VL, "qwen3_vl_moe": models.PruningQwen3VLMoe}
"""Each tiny checkpoint's fixture name (without ``_dir``) and the class that must serve it."""


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(the family's name, its tiny checkpoint's path)."""
    return request.param, request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="module")
def checkpoint(family):
    """The module's checkpoint: the dense or the MoE one."""
    return family[1]


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = LLM(
        model=str(checkpoint),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        limit_mm_per_prompt={"image": 2, "video": 0},
        **ENGINE,
    )
    yield engine
    del engine


CASES = [
    (ONE, [image(128, 0)], None),
    (TWO, [image(128, 1), image(64, 2)], None),  # 16 + 4 tokens: the budget splits 5 + 1
    (TWO, [image(128, 3), image(128, 4)], {"budget": 10}),
    (ONE, [image(128, 5)], {"enabled": False}),  # an unpruned image in a pruned step
    (TEXT_ONLY, [], None),
]


def test_one_step_of_images_text_budgets_and_pruning_off(llm, family, checkpoint):
    assert llm.apply_model(type) == [FAMILIES[family[0]]]
    outs = generate(llm, CASES)
    for index, ((prompt, images, budget), out) in enumerate(zip(CASES, outs, strict=True)):
        expected = hf_tokens(checkpoint, prompt, images, apply_settings(SETTINGS, images, budget), TOKENS)
        assert list(out.outputs[0].token_ids) == expected, index
    assert [len(out.prompt_token_ids) for out in outs] == [9 + 6, 12 + 6, 12 + 10, 9 + 16, 9]
    assert hf_tokens(checkpoint, *CASES[1][:2], None, TOKENS) != list(outs[1].outputs[0].token_ids)


def test_requests_arriving_while_others_decode(llm, checkpoint):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    cases = [
        (ONE, [image(128, 10)], None),
        (TWO, [image(64, 11), image(128, 12)], {"budget": 4}),
        (ONE, [image(128, 13)], {"enabled": False}),
        (TEXT_ONLY, [], None),
        (ONE, [image(64, 14)], {"budget": 2}),
    ]
    arrivals = {0: [0], 2: [1, 2], 5: [3, 4]}  # engine step -> requests added before it
    requests = {index: vllm_request(*cases[index]) for index in range(len(cases))}
    results = run_arrivals(engine, requests, arrivals, params)
    for index, (prompt, images, budget) in enumerate(cases):
        expected = hf_tokens(checkpoint, prompt, images, apply_settings(SETTINGS, images, budget), TOKENS)
        assert results[index] == expected, index


def test_pruned_prompt_without_deepstack_is_caught(llm, checkpoint, monkeypatch):
    """Negative control: the pruned prompt's layers 0..L run without its DeepStack features (its encoder
    rows cut to the embeddings); the answer must differ from apply's."""
    original = models.prefill_prompt

    def without_deepstack(prompt, inputs_embeds, *args, **kwargs):
        width = inputs_embeds.shape[1]
        images = [(column, rows[:, :width]) for column, rows in prompt.images]
        return original(dataclasses.replace(prompt, images=images), inputs_embeds, *args, **kwargs)

    monkeypatch.setattr(models, "prefill_prompt", without_deepstack)
    case = CASES[0]
    out = generate(llm, [case])[0]
    assert list(out.outputs[0].token_ids) != hf_tokens(checkpoint, *case[:2], SETTINGS, TOKENS)


def test_unpruned_rows_without_deepstack_are_caught(llm, checkpoint, monkeypatch):
    """Negative control: in a step with a pruned prompt, the other rows (an unpruned image) get no
    DeepStack features; that request's answer must differ from stock HF's."""
    original = models.PruningQwen3VL._step_injections  # still run: it clears vLLM's buffer
    monkeypatch.setattr(
        models.PruningQwen3VL, "_step_injections", lambda self, rows: original(self, rows)[:0]
    )
    outs = generate(llm, [CASES[0], CASES[3]])
    assert list(outs[1].outputs[0].token_ids) != hf_tokens(checkpoint, *CASES[3][:2], None, TOKENS)


def test_decoding_one_position_off_is_caught(llm, checkpoint, monkeypatch):
    """Negative control: a pruned request decoding one position off its original positions."""
    shift_decode_offset(monkeypatch)
    out = generate(llm, [CASES[0]])[0]
    assert list(out.outputs[0].token_ids) != hf_tokens(checkpoint, *CASES[0][:2], SETTINGS, TOKENS)


def test_kept_keys_and_values_left_out_of_the_cache_are_caught(llm, checkpoint, monkeypatch):
    """Negative control: the paged cache of layers 0..L holds zeros for the kept tokens."""
    skip_kv_rewrite(monkeypatch)
    out = generate(llm, [CASES[0]])[0]
    assert list(out.outputs[0].token_ids) != hf_tokens(checkpoint, *CASES[0][:2], SETTINGS, TOKENS)


@pytest.mark.parametrize("hidden", [True, False])
def test_moe_blocks_of_a_whole_prompt_see_no_padding_mask(llm, family, monkeypatch, hidden):
    """The step's padding mask (vLLM's ``is_padding``, which its GPU routers apply to the first rows of
    a MoE block's input; the CPU build's router ignores it, so this checks what the blocks are shown)
    is hidden while the pruned prompt runs whole (9 + 16 rows in a step of 9 + 6) and shown for the
    step's own rows. Negative control (``hidden`` False): without ``unpadded_rows`` the whole prompt's
    block gets the step's mask, shorter than its rows."""
    if family[0] != "qwen3_vl_moe":
        pytest.skip("dense Qwen3-VL has no MoE blocks")
    seen = []
    original = Qwen3MoeSparseMoeBlock.forward

    def recording(self, hidden_states):
        padding = get_forward_context().is_padding
        seen.append((hidden_states.shape[0], None if padding is None else padding.shape[0]))
        return original(self, hidden_states)

    monkeypatch.setattr(Qwen3MoeSparseMoeBlock, "forward", recording)
    if not hidden:
        monkeypatch.setattr(models, "unpadded_rows", contextlib.nullcontext)
    generate(llm, [CASES[0]], tokens=1)
    whole = (9 + 16, None) if hidden else (9 + 16, 9 + 6)
    assert seen == [whole, (9 + 6, 9 + 6), (9 + 6, 9 + 6)]  # layer 1 on the prompt, layers 2-3 on the step


def test_preemption_by_recompute_is_exact(checkpoint):
    """A KV cache of 4 blocks of 32 tokens (3 usable) cannot hold four 18-token prompts decoding 40
    tokens each: vLLM preempts and re-prefills prompt + generated tokens in one step."""
    engine = LLM(
        model=str(checkpoint),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        limit_mm_per_prompt={"image": 2, "video": 0},
        num_gpu_blocks_override=4,
        disable_log_stats=False,
        block_size=32,
        **{**ENGINE, "max_model_len": 96, "max_num_batched_tokens": 96},
    )
    cases = [(TWO, [image(128, 20 + i), image(64, 30 + i)]) for i in range(4)]
    outs = generate(engine, cases, tokens=40)
    stats = engine.llm_engine.get_metrics()
    for (prompt, images), out in zip(cases, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_tokens(checkpoint, prompt, images, SETTINGS, 40)
    preempted = [metric for metric in stats if metric.name == "vllm:num_preemptions"]
    assert preempted and preempted[0].value > 0, "the cache was large enough: nothing was preempted"
    del engine
