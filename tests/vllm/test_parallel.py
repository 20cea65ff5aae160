"""Scale-out on vLLM's CPU build, where each rank is a process on this machine: tensor parallelism 2
(offline ``LLM``, the multiprocessing executor) and data parallelism 2 (the OpenAI server: vLLM's
offline ``LLM`` refuses data parallelism for a dense model) of a dense model, against priortr.apply +
HF generate(); Qwen3-VL MoE's are ``test_moe_parallel.py``.

Under tensor parallelism each rank holds half the heads of layer L; the scores need every head, so
the ranks gather their attention rows before choosing (``decoder.LayerParts.every_head``). The
negative control shows that on these prompts either rank's heads alone would keep other tokens.
"""

from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from vllm import LLM, SamplingParams

import priortr
from priortr.engine import evidence
from tests.vllm import reference, test_http
from tests.vllm.reference import ENGINE, LLAVA_PROMPT, hf_tokens, image
from tests.vllm.test_http import QUESTION, chat, serving
from tests.vllm.test_http import TOKENS as HTTP_TOKENS

SETTINGS = {"method": "priortr", "budget": 4, "layer": 1}
REQUEST_BUDGETS = [6, 2, 8]
"""The budgets this module's requests ask for, which the engine grants (its ``request_budgets``)."""
HEADS = 4
TOKENS = 12
QUESTIONS = ["what is in the image", "describe this picture a cat", "is the cat red or blue in this image"]
TEXT_ONLY = "<s>USER: what is the color of the cat ASSISTANT:"
DP_START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def tp_llm(llava_dir):
    engine = LLM(
        model=str(llava_dir),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        **{**ENGINE, "tensor_parallel_size": 2, "distributed_executor_backend": "mp", "enforce_eager": False},
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def kept(path, question: str, picture, heads: slice | None) -> list[int]:
    """The prompt positions HF + priortr.apply keeps on one prefill, scoring with every head of layer
    L (``heads`` None) or with ``heads`` of them only."""
    processor, model = reference._model(str(path))
    inputs = processor(
        text=LLAVA_PROMPT.format(question), images=[picture], return_tensors="pt", add_special_tokens=False
    )
    rows = evidence.attention_rows

    def some_heads(*args, **kwargs):
        return rows(*args, **kwargs)[:, heads]

    patched = nullcontext() if heads is None else mock.patch.object(evidence, "attention_rows", some_heads)
    with patched, priortr.apply(model, **SETTINGS) as handle, torch.no_grad():
        model(**inputs)
    return handle.last.kept[0].tolist()


def test_tensor_parallel_2_is_exact(tp_llm, llava_dir):
    cases = [
        {"prompt": LLAVA_PROMPT.format(QUESTIONS[i]), "multi_modal_data": {"image": image(28, 70 + i)}}
        for i in range(3)
    ]
    cases[1]["mm_processor_kwargs"] = {"priortr": {"budget": 6}}
    cases[2]["mm_processor_kwargs"] = {"priortr": {"enabled": False}}
    cases.append({"prompt": TEXT_ONLY})
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    outs = tp_llm.generate(cases, params, use_tqdm=False)
    settings = [SETTINGS, {**SETTINGS, "budget": 6}, None]
    for i, out in enumerate(outs[:3]):
        want = hf_tokens(
            llava_dir, LLAVA_PROMPT.format(QUESTIONS[i]), [image(28, 70 + i)], settings[i], TOKENS
        )
        assert list(out.outputs[0].token_ids) == want, i
    assert list(outs[3].outputs[0].token_ids) == hf_tokens(llava_dir, TEXT_ONLY, [], None, TOKENS)
    assert [len(out.prompt_token_ids) for out in outs[:3]] == [9 + 4, 9 + 6, 13 + 16]


def test_one_ranks_heads_would_keep_other_tokens(llava_dir):
    """Negative control of the gather: on the first prompt of the test above, the kept set from layer
    L's heads 0-1 (rank 0's) or 2-3 (rank 1's) differs from the kept set from all four."""
    picture = image(28, 70)
    every = kept(llava_dir, QUESTIONS[0], picture, None)
    assert len(every) == SETTINGS["budget"]
    for half in (slice(0, HEADS // 2), slice(HEADS // 2, HEADS)):
        assert kept(llava_dir, QUESTIONS[0], picture, half) != every, half


def test_data_parallel_2_over_http_is_exact(llava_dir, tmp_path_factory, monkeypatch):
    """Two engine cores behind one server (vLLM runs a dense model's replicas independently, without
    the padding steps it adds for MoE models); eight concurrent chats at mixed budgets, and vLLM's
    metrics show that both engines finished some. Five processes start on this machine's two cores:
    the server gets longer to answer /health than one engine does."""
    monkeypatch.setattr(test_http, "START_TIMEOUT_S", DP_START_TIMEOUT_S)
    budgets = [None, {"budget": 2}, {"enabled": False}, {"budget": 8}] * 2
    pictures = [image(28, 80 + i) for i in range(len(budgets))]
    log_dir = tmp_path_factory.mktemp("serve-dp")
    with serving(
        llava_dir, log_dir, {**SETTINGS, "request_budgets": REQUEST_BUDGETS}, "--data-parallel-size=2"
    ) as url:
        with ThreadPoolExecutor(len(budgets)) as pool:
            answers = list(pool.map(lambda p, b: chat(url, str(llava_dir), [p], b), pictures, budgets))
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
            metrics = reply.read().decode()
    prompt = f"<s>USER: <image>\n{QUESTION} ASSISTANT:"  # the checkpoint's chat template
    for picture, budget, answer in zip(pictures, budgets, answers, strict=True):
        settings = None if budget == {"enabled": False} else {**SETTINGS, **(budget or {})}
        assert answer == hf_tokens(llava_dir, prompt, [picture], settings, HTTP_TOKENS)
    finished = {
        match.group(1)
        for match in re.finditer(
            r'^vllm:request_success_total\{[^}]*engine="(\d+)"[^}]*\} ([0-9.e+]+)$', metrics, re.M
        )
        if float(match.group(2)) > 0
    }
    assert finished == {"0", "1"}, "one engine core served every request"
