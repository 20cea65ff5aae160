"""What one request can do to the engine (issue 46, items 2 and 4): a pruned request never asks for a
position the model does not have, and a request's own data never reaches the model in a form it must
refuse there (a raise in the model's forward ends vLLM's engine, every request in flight with it).

Positions: a pruned request decodes at its original positions, ahead of its scheduled tokens by the
tokens pruned. On an engine whose ``max_model_len`` is the checkpoint's ``max_position_embeddings`` (the
size of its RoPE table, vLLM's default), an answer that runs to the limit must end with reason
``length`` where the unpruned request's answer ends, and a prompt too long unpruned is refused alone.

Image identity: two requests sending images of different sizes under one client ``uuid`` (same
question, same K, vLLM's processor cache off so the frontend cannot mask it) must each be answered
about their own image, and the engine must go on serving.
"""

from __future__ import annotations

import pytest
import torch
from vllm import LLM, SamplingParams

from priortr.integrations.vllm import processor
from tests.vllm.harness import ANSWER_TOKENS
from tests.vllm.reference import ENGINE, LLAVA_PROMPT, QWEN_IMAGE, hf_tokens, image

LLAVA = {"method": "priortr", "budget": 4, "layer": 1}
QWEN = {"method": "fastv", "budget": 2, "layer": 1}
QUESTION = "what is in the image"
QWEN_PROMPT = f"USER: {QWEN_IMAGE} {QUESTION} ASSISTANT:"
LLAVA_TOKENS = 16  # visual tokens of the tiny LLaVA's image


@pytest.fixture(scope="module")
def positions_limit(llava_dir) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(llava_dir).text_config.max_position_embeddings


@pytest.fixture(scope="module")
def llava(llava_dir, positions_limit):
    """LLaVA served with ``max_model_len`` = ``max_position_embeddings``."""
    limits = {"max_model_len": positions_limit, "max_num_batched_tokens": positions_limit}
    engine = LLM(model=str(llava_dir), hf_overrides={"priortr": LLAVA}, **{**ENGINE, **limits})
    yield engine
    del engine


def llava_request(question: str, seed: int, budget: dict | None = None) -> dict:
    out = {"prompt": LLAVA_PROMPT.format(question), "multi_modal_data": {"image": image(28, seed)}}
    if budget is not None:
        out["mm_processor_kwargs"] = {"priortr": budget}
    return out


def test_answer_ends_where_the_unpruned_answer_ends(llava, llava_dir, positions_limit):
    """An answer asked to run far past the limit (ignore_eos) ends with reason ``length`` at the
    unpruned request's length (on main it ran on to the short prompt's limit, positions past the RoPE
    table, which the CPU build does not catch); the next request is served."""
    long = SamplingParams(max_tokens=4 * positions_limit, temperature=0.0, ignore_eos=True)
    pruned, unpruned = llava.generate(
        [llava_request(QUESTION, 0), llava_request(QUESTION, 0, {"enabled": False})], long, use_tqdm=False
    )
    unpruned_prompt = len(pruned.prompt_token_ids) - LLAVA["budget"] + LLAVA_TOKENS
    assert len(unpruned.prompt_token_ids) == unpruned_prompt
    for out in (pruned, unpruned):
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == positions_limit - unpruned_prompt
    short = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
    (after,) = llava.generate([llava_request(QUESTION, 1)], short, use_tqdm=False)
    expected = hf_tokens(llava_dir, LLAVA_PROMPT.format(QUESTION), [image(28, 1)], LLAVA, ANSWER_TOKENS)
    assert list(after.outputs[0].token_ids) == expected


def test_prompt_too_long_unpruned_is_refused_alone(llava, llava_dir, positions_limit):
    """A prompt that fits ``max_model_len`` pruned (text + K) but not unpruned (text + N) is refused
    in the processor, before the engine sees it; the next request is served."""
    tokenizer = llava.get_tokenizer()

    def unpruned_length(question: str) -> int:
        laid_out = tokenizer(LLAVA_PROMPT.format(question), add_special_tokens=False)["input_ids"]
        return len(laid_out) - 1 + LLAVA_TOKENS  # the one <image> token laid out as N

    words = ["cat"]
    while unpruned_length(" ".join(words)) <= positions_limit:
        words.append("cat")
    question = " ".join(words)
    assert unpruned_length(question) - LLAVA_TOKENS + LLAVA["budget"] <= positions_limit
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match="tokens unpruned where the model places"):
        llava.generate([llava_request(question, 2)], params, use_tqdm=False)
    (after,) = llava.generate([llava_request(QUESTION, 3)], params, use_tqdm=False)
    expected = hf_tokens(llava_dir, LLAVA_PROMPT.format(QUESTION), [image(28, 3)], LLAVA, ANSWER_TOKENS)
    assert list(after.outputs[0].token_ids) == expected


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    """Qwen2-VL without vLLM's processor cache: every request's items reach the engine."""
    engine = LLM(
        model=str(qwen_dir),
        hf_overrides={"priortr": QWEN},
        limit_mm_per_prompt={"image": 1, "video": 0},
        mm_processor_cache_gb=0,
        **ENGINE,
    )
    yield engine
    del engine


def uuid_answers(llm: LLM, pictures: list, uuids: list[str]) -> list[list[int]]:
    """The answers to one question about each picture, sent one after another under ``uuids``."""
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
    answers = []
    for picture, uuid in zip(pictures, uuids, strict=True):
        request = {
            "prompt": QWEN_PROMPT,
            "multi_modal_data": {"image": picture},
            "multi_modal_uuids": {"image": [uuid]},
        }
        (out,) = llm.generate([request], params, use_tqdm=False)
        assert len(out.prompt_token_ids) == 9 + QWEN["budget"]
        answers.append(list(out.outputs[0].token_ids))
    return answers


def test_one_uuid_for_two_image_sizes(qwen, qwen_dir):
    """A 56x56 image (4 tokens) then a 112x112 one (16) under the uuid "picture", the same question and
    K = 2: on main both had one identity, the second request met the first image's 4 encoder rows and the
    model raised, ending the engine. Each is answered about its own image, and a third request after."""
    pictures = [image(56, 40), image(112, 41), image(112, 42)]
    answers = uuid_answers(qwen, pictures, ["picture", "picture", "another"])
    for picture, answer in zip(pictures, answers, strict=True):
        assert answer == hf_tokens(qwen_dir, QWEN_PROMPT, [picture], QWEN, ANSWER_TOKENS)


GRIDS = [image(112, 50, height=56), image(56, 51, height=112)]
"""Two images of 8 tokens each, a 2 x 4 and a 4 x 2 grid (M-RoPE places them differently)."""


def test_one_uuid_for_two_grids_of_one_size(qwen, qwen_dir):
    """Images of the same N and different grids under one uuid: each answered about its own image."""
    answers = uuid_answers(qwen, GRIDS, ["grids", "grids"])
    for picture, answer in zip(GRIDS, answers, strict=True):
        assert answer == hf_tokens(qwen_dir, QWEN_PROMPT, [picture], QWEN, ANSWER_TOKENS)


def test_identity_without_the_grid_is_caught(qwen, qwen_dir, monkeypatch):
    """Negative control: with the image's fields left out of its identity, the second image of the same
    N is served the first one's encoder rows and its answer differs from priortr.apply's."""
    monkeypatch.setattr(processor, "encoder_shapes", lambda item: "")
    first, second = uuid_answers(qwen, GRIDS, ["no grid", "no grid"])
    assert first == hf_tokens(qwen_dir, QWEN_PROMPT, [GRIDS[0]], QWEN, ANSWER_TOKENS)
    assert second != hf_tokens(qwen_dir, QWEN_PROMPT, [GRIDS[1]], QWEN, ANSWER_TOKENS)


class Field:
    """A processed item's field as ``encoder_shapes`` reads it (vLLM's ``MultiModalFieldElem.data``)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data


def test_identity_digests_integer_fields_whatever_their_size():
    """A Qwen3-VL image of 768 x 768 pixels is processed into 2304 x 1536 uint8 patch values: its
    identity stays a few digests long (it was the values written out, 3.5 M numbers, about 1 s a
    request on this CPU), while the grid's values and the fields' shapes and dtypes still tell items
    apart."""
    pixels = torch.randint(0, 256, (2304, 1536), dtype=torch.uint8)
    item = {"pixel_values": Field(pixels), "image_grid_thw": Field(torch.tensor([[1, 48, 48]]))}
    identity = processor.encoder_shapes(item)
    assert len(identity) < 200
    assert identity == processor.encoder_shapes({key: Field(f.data.clone()) for key, f in item.items()})
    others = [
        {**item, "image_grid_thw": Field(torch.tensor([[1, 24, 96]]))},  # the same N, another grid
        {**item, "pixel_values": Field(pixels.to(torch.int16))},
        {**item, "pixel_values": Field(pixels[:1152])},
        {**item, "pixel_values": Field(torch.roll(pixels, 1, 0))},
    ]
    assert len({identity, *(processor.encoder_shapes(other) for other in others)}) == 5
    floats = {"pixel_values": Field(torch.rand(4, 3))}
    assert processor.encoder_shapes(floats) == "pixel_values[4x3]torch.float32"  # floats: shape alone


def test_prompt_too_long_whole_is_refused_alone(qwen, qwen_dir):
    """A prompt that fits a step pruned (text + K) but not whole (text + N; the step is 256 tokens) is
    refused in the processor: layers 0..L run on it whole in one step, past the tokens vLLM's start-up
    memory profile ran (on main it was served, alone in its step). The next request is served."""
    tokenizer = qwen.get_tokenizer()
    picture, tokens = image(112, 60), 16  # 8 x 8 patches, merged 2 x 2

    def whole_length(question: str) -> int:
        laid_out = tokenizer(f"USER: {QWEN_IMAGE} {question} ASSISTANT:", add_special_tokens=False)[
            "input_ids"
        ]
        return len(laid_out) - 1 + tokens  # the one <|image_pad|> laid out as N

    words = ["cat"]
    while whole_length(" ".join(words)) <= ENGINE["max_num_batched_tokens"]:
        words.append("cat")
    question = " ".join(words)
    assert whole_length(question) - tokens + QWEN["budget"] <= ENGINE["max_num_batched_tokens"]
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
    long = {"prompt": f"USER: {QWEN_IMAGE} {question} ASSISTANT:", "multi_modal_data": {"image": picture}}
    with pytest.raises(ValueError, match="a step's memory was profiled for 256"):
        qwen.generate([long], params, use_tqdm=False)
    (after,) = qwen.generate([{"prompt": QWEN_PROMPT, "multi_modal_data": {"image": picture}}], params)
    assert list(after.outputs[0].token_ids) == hf_tokens(
        qwen_dir, QWEN_PROMPT, [picture], QWEN, ANSWER_TOKENS
    )
