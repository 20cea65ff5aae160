"""LLaVA-1.5 (1-D RoPE) served by vLLM with the plug-in, against priortr.apply + HF generate().

One in-process engine serves every test of this module (engine start is the slow part); each case
is also run with a fault patched into the plug-in, whose answers must then differ (the tests can fail).
"""

from __future__ import annotations

import pytest
import torch
from vllm import LLM, SamplingParams

from priortr.integrations.vllm import models
from tests.vllm.harness import run_arrivals, shift_decode_offset, skip_kv_rewrite
from tests.vllm.reference import ENGINE, LLAVA_PROMPT, hf_tokens, image

SETTINGS = {"method": "priortr", "budget": 4, "layer": 1}
REQUEST_BUDGETS = [8, 2, 6]
"""The budgets this module's requests ask for, which the engine grants (its ``request_budgets``)."""
TOKENS = 12
QUESTIONS = ["what is in the image", "describe this picture a cat", "is the cat red or blue in this image"]


@pytest.fixture(scope="module")
def llm(llava_dir):
    engine = LLM(
        model=str(llava_dir),
        hf_overrides={"priortr": {**SETTINGS, "request_budgets": REQUEST_BUDGETS}},
        enable_mm_embeds=True,
        **ENGINE,
    )
    yield engine
    del engine


def request(question: str, seed: int, budget: dict | None = None) -> dict:
    out = {"prompt": LLAVA_PROMPT.format(question), "multi_modal_data": {"image": image(28, seed)}}
    if budget is not None:
        out["mm_processor_kwargs"] = {"priortr": budget}
    return out


def generate(llm: LLM, requests: list[dict]) -> list:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    return llm.generate(requests, params, use_tqdm=False)


def test_one_request_matches_hf(llm, llava_dir):
    assert llm.apply_model(type) == [models.PruningLlava]
    out = generate(llm, [request(QUESTIONS[0], 0)])[0]
    expected = hf_tokens(llava_dir, LLAVA_PROMPT.format(QUESTIONS[0]), [image(28, 0)], SETTINGS, TOKENS)
    assert list(out.outputs[0].token_ids) == expected
    assert len(out.prompt_token_ids) == 9 + SETTINGS["budget"]  # text + K, not text + N = 16
    stock = hf_tokens(llava_dir, LLAVA_PROMPT.format(QUESTIONS[0]), [image(28, 0)], None, TOKENS)
    assert expected != stock  # the pruning really changed the answer


def test_step_mixing_image_and_text_prompts(llm, llava_dir):
    text_only = "<s>USER: what is the color of the cat ASSISTANT:"
    outs = generate(llm, [request(QUESTIONS[1], 1), {"prompt": text_only}, request(QUESTIONS[2], 2)])
    assert list(outs[0].outputs[0].token_ids) == hf_tokens(
        llava_dir, LLAVA_PROMPT.format(QUESTIONS[1]), [image(28, 1)], SETTINGS, TOKENS
    )
    assert list(outs[1].outputs[0].token_ids) == hf_tokens(llava_dir, text_only, [], None, TOKENS)
    assert list(outs[2].outputs[0].token_ids) == hf_tokens(
        llava_dir, LLAVA_PROMPT.format(QUESTIONS[2]), [image(28, 2)], SETTINGS, TOKENS
    )


def test_per_request_budget_and_pruning_off(llm, llava_dir):
    outs = generate(
        llm, [request(QUESTIONS[0], 3, {"budget": 8}), request(QUESTIONS[0], 3, {"enabled": False})]
    )
    prompt, images = LLAVA_PROMPT.format(QUESTIONS[0]), [image(28, 3)]
    assert list(outs[0].outputs[0].token_ids) == hf_tokens(
        llava_dir, prompt, images, {**SETTINGS, "budget": 8}, TOKENS
    )
    assert len(outs[0].prompt_token_ids) == 9 + 8
    assert list(outs[1].outputs[0].token_ids) == hf_tokens(llava_dir, prompt, images, None, TOKENS)
    assert len(outs[1].prompt_token_ids) == 9 + 16


def test_image_embeddings_are_refused_when_pruned_and_served_when_not(llm):
    """The plug-in sizes an image from its pixels, so a pruned request sending image embeddings is
    refused in the front end (a ValueError, an HTTP 400 from the server) instead of failing the engine;
    the same embeddings with pruning off are served."""
    width = llm.llm_engine.model_config.hf_config.text_config.hidden_size
    embedded = {
        "prompt": LLAVA_PROMPT.format(QUESTIONS[0]),
        "multi_modal_data": {"image": torch.randn(1, 16, width)},  # one image, the checkpoint's N = 16
    }
    with pytest.raises(ValueError, match="image embeddings"):
        generate(llm, [embedded])
    out = generate(llm, [{**embedded, "mm_processor_kwargs": {"priortr": {"enabled": False}}}])[0]
    assert len(out.outputs[0].token_ids) == TOKENS
    assert len(out.prompt_token_ids) == 9 + 16


def test_requests_arriving_while_others_decode(llm, llava_dir):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    arrivals = {0: [0], 2: [1, 2], 5: [3]}  # engine step -> requests added before it
    budgets = [None, {"budget": 2}, {"enabled": False}, {"budget": 6}]
    requests = {
        index: request(QUESTIONS[index % 3], 10 + index, budgets[index]) for index in range(len(budgets))
    }
    results = run_arrivals(engine, requests, arrivals, params)
    for index, budget in enumerate(budgets):
        settings = SETTINGS if budget is None else ({**SETTINGS, **budget} if "budget" in budget else None)
        expected = hf_tokens(
            llava_dir, LLAVA_PROMPT.format(QUESTIONS[index % 3]), [image(28, 10 + index)], settings, TOKENS
        )
        assert results[index] == expected, index


def test_wrong_decode_offset_is_caught(llm, llava_dir, monkeypatch):
    """Negative control: decoding one position off the original positions changes the answer."""
    shift_decode_offset(monkeypatch)
    out = generate(llm, [request(QUESTIONS[0], 0)])[0]
    expected = hf_tokens(llava_dir, LLAVA_PROMPT.format(QUESTIONS[0]), [image(28, 0)], SETTINGS, TOKENS)
    assert list(out.outputs[0].token_ids) != expected


def test_skipped_kv_rewrite_is_caught(llm, llava_dir, monkeypatch):
    """Negative control: leaving layers 0..L's cache without the kept tokens' keys/values changes the
    answer."""
    skip_kv_rewrite(monkeypatch)
    out = generate(llm, [request(QUESTIONS[0], 0)])[0]
    expected = hf_tokens(llava_dir, LLAVA_PROMPT.format(QUESTIONS[0]), [image(28, 0)], SETTINGS, TOKENS)
    assert list(out.outputs[0].token_ids) != expected


def test_adjacent_images_are_one_run_under_one_budget(llm, llava_dir):
    """Two images with no text between them (a raw prompt: LLaVA-1.5's llava-hf template writes
    ``<image>\\n`` per image) are one run of 2 x 16 tokens keeping 4 under one budget, as priortr.apply
    prunes them, in a step with a one-image request."""
    prompt = LLAVA_PROMPT.replace("<image>", "<image><image>").format(QUESTIONS[0])
    images = [image(28, 40), image(28, 41)]
    outs = generate(
        llm, [{"prompt": prompt, "multi_modal_data": {"image": images}}, request(QUESTIONS[1], 42)]
    )
    assert list(outs[0].outputs[0].token_ids) == hf_tokens(llava_dir, prompt, images, SETTINGS, TOKENS)
    assert len(outs[0].prompt_token_ids) == 9 + SETTINGS["budget"]  # one run's K, not K per image
    assert list(outs[1].outputs[0].token_ids) == hf_tokens(
        llava_dir, LLAVA_PROMPT.format(QUESTIONS[1]), [image(28, 42)], SETTINGS, TOKENS
    )
    assert hf_tokens(llava_dir, prompt, images, None, TOKENS) != list(outs[0].outputs[0].token_ids)
