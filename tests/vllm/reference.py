"""The answers the vLLM plug-in must reproduce: ``priortr.apply`` + Hugging Face ``generate()``
(greedy, float32) on the same checkpoint, and the prompts and images both sides get."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

import priortr

LLAVA_PROMPT = "<s>USER: <image>\n {} ASSISTANT:"
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ENGINE = {
    "max_model_len": 256,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 8,
    "enforce_eager": True,
    "dtype": "float32",
    "seed": 0,
    "distributed_executor_backend": "uni",
}


def image(size: int, seed: int, height: int | None = None) -> Image.Image:
    """A random RGB image, ``size`` wide and ``height`` (default ``size``) high."""
    pixels = np.random.RandomState(seed).rand(height or size, size, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def vllm_request(prompt: str, images: list[Image.Image], budget: dict | None = None) -> dict:
    """vLLM's prompt dict for ``prompt`` with its images (one or several) and, unless None, the
    request's ``priortr`` setting."""
    out: dict = {"prompt": prompt}
    if images:
        out["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
    if budget is not None:
        out["mm_processor_kwargs"] = {"priortr": budget}
    return out


@cache
def _model(path: str) -> tuple[Any, Any]:
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return processor, model


def hf_tokens(
    path: Path,
    prompt: str,
    images: list[Image.Image],
    settings: dict | None,
    max_tokens: int,
    withheld: tuple[str, ...] = (),
) -> list[int]:
    """Greedy tokens of ``generate()`` on the prompt, pruned by ``priortr.apply(**settings)`` unless
    ``settings`` is None; the processor's outputs named in ``withheld`` are not handed to the model."""
    processor, model = _model(str(path))
    kwargs = {"images": images} if images else {}
    inputs = processor(text=prompt, return_tensors="pt", add_special_tokens=False, **kwargs)
    for name in withheld:
        inputs.pop(name)
    generate = {"max_new_tokens": max_tokens, "do_sample": False, "eos_token_id": None}
    if settings is None:
        out = model.generate(**inputs, **generate)
    else:
        with priortr.apply(model, **settings):
            out = model.generate(**inputs, **generate)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
