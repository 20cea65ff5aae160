"""vLLM's compiled model (no enforce_eager): on the CPU build its default compilation, a Dynamo trace
of the language model compiled by Inductor. Steps without a pruned prompt run the compiled language
model; a step with one runs the layers one by one (docs/serving.md, Compiled models and CUDA graphs).

The answers must equal priortr.apply + Hugging Face generate() in a mixed stream (pruned, per-request
budget, pruning off, text only, arriving while others decode), and the counts must show where each
step ran: every step that is not a pruned prefill calls the compiled module and no decoder layer's
Python forward (the compiled code runs instead), and every pruned prefill runs layers L+1.. eagerly
and never calls the compiled module (the same counter counting those eager calls is its own check).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.config.compilation import CompilationMode
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel

from priortr.integrations.vllm import models, served_families
from tests.vllm.harness import run_arrivals
from tests.vllm.reference import ENGINE, LLAVA_PROMPT, hf_tokens, image, vllm_request

SETTINGS = {"method": "priortr", "budget": 4, "layer": 1}
REQUEST_BUDGETS = [2, 6]
"""The budgets this module's requests ask for, which the engine grants (its ``request_budgets``)."""
N_LAYERS = 4
TOKENS = 12
QUESTIONS = ["what is in the image", "describe this picture a cat", "is the cat red or blue in this image"]
TEXT_ONLY = "<s>USER: what is the color of the cat ASSISTANT:"


@pytest.fixture(scope="module")
def llm(llava_dir):
    engine = LLM(
        model=str(llava_dir),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        **{**ENGINE, "enforce_eager": False},
    )
    yield engine
    del engine


def request(index: int, budget: dict | None) -> dict:
    if index == 4:
        return vllm_request(TEXT_ONLY, [])
    return vllm_request(LLAVA_PROMPT.format(QUESTIONS[index % 3]), [image(28, 40 + index)], budget)


def expected(llava_dir, index: int, budget: dict | None) -> list[int]:
    if index == 4:
        return hf_tokens(llava_dir, TEXT_ONLY, [], None, TOKENS)
    settings = None if budget == {"enabled": False} else {**SETTINGS, **(budget or {})}
    return hf_tokens(
        llava_dir, LLAVA_PROMPT.format(QUESTIONS[index % 3]), [image(28, 40 + index)], settings, TOKENS
    )


def test_the_language_model_is_compiled(llm):
    def compiled(model) -> tuple:
        text = model.language_model.model
        ready = text.compiled or getattr(text, "aot_compiled_fn", None) is not None  # or loaded from disk
        return type(model), type(text), text.do_not_compile, ready, text.vllm_config.compilation_config.mode

    kind, text_kind, skipped, ready, mode = llm.apply_model(compiled)[0]
    assert (kind, text_kind, skipped, ready) == (served_families.PruningLlava, LlamaModel, False, True)
    assert mode == CompilationMode.DYNAMO_TRACE_ONCE  # the CPU build's default compilation


def test_mixed_stream_is_exact_and_runs_compiled_where_it_can(llm, llava_dir, monkeypatch):
    calls: Counter[str] = Counter()
    compiled_call, layer_forward = LlamaModel.__call__, LlamaDecoderLayer.forward
    stock_forward, pruned_forward = models.PruningModel.forward, models.run_step

    def count_compiled(self, *args, **kwargs):
        calls["compiled"] += 1
        return compiled_call(self, *args, **kwargs)

    def count_layer(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            calls["eager layer"] += 1
        return layer_forward(self, *args, **kwargs)

    def count_step(self, *args, **kwargs):
        calls["step"] += 1
        return stock_forward(self, *args, **kwargs)

    def count_pruned(*args, **kwargs):
        calls["pruned step"] += 1
        return pruned_forward(*args, **kwargs)

    monkeypatch.setattr(LlamaModel, "__call__", count_compiled)
    monkeypatch.setattr(LlamaDecoderLayer, "forward", count_layer)
    monkeypatch.setattr(models.PruningModel, "forward", count_step)
    monkeypatch.setattr(models, "run_step", count_pruned)

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    budgets = [None, {"budget": 2}, {"enabled": False}, {"budget": 6}, None, None]
    arrivals = {0: [0, 4], 2: [1, 2], 5: [3], 7: [5]}  # engine step -> requests added before it
    requests = {index: request(index, budgets[index]) for index in range(len(budgets))}
    results = run_arrivals(engine, requests, arrivals, params)
    for index, budget in enumerate(budgets):
        assert results[index] == expected(llava_dir, index, budget), index

    pruned, stock = calls["pruned step"], calls["step"] - calls["pruned step"]
    assert pruned == 4 and stock >= TOKENS  # requests 0, 1, 3 and 5 arrive in four steps; decodes follow
    assert calls["compiled"] == stock  # every other step ran the compiled language model
    assert calls["eager layer"] == pruned * (
        N_LAYERS - SETTINGS["layer"] - 1
    )  # only pruned steps ran eagerly
