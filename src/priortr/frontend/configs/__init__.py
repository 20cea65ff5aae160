"""True-shape configs of the models the paper measures, shipped so that nothing is downloaded.

Each JSON file is the ``config.json`` of a public checkpoint, as transformers wrote it there:

- ``llava-1.5-7b``: ``llava-hf/llava-1.5-7b-hf``. Llama (Vicuna-7B): D 4096, 32 layers, 32 heads,
  H 11008, vocab 32064; CLIP ViT-L/14-336 (D 1024, 24 layers, 16 heads, H 4096), 576 image tokens.
- ``llava-1.5-13b``: ``llava-hf/llava-1.5-13b-hf``. Llama (Vicuna-13B): D 5120, 40 layers, 40 heads,
  H 13824; the same CLIP tower.
- ``qwen2.5-vl-7b``: ``Qwen/Qwen2.5-VL-7B-Instruct``. Qwen2: D 3584, 28 layers, 28 heads / 4 KV heads,
  H 18944, vocab 152064; vision: 32 blocks, D 1280, H 3420 (SwiGLU), windowed except 7/15/23/31.

The LLaVA files state the Llama shape explicitly (the hub files leave it to ``LlamaConfig`` defaults),
so that they do not depend on the defaults of the installed transformers. They only hold shapes and
token ids: ``load_config`` gives a ``PretrainedConfig`` from which a model with random weights can be
built (``AutoModelForImageTextToText.from_config``), or whose shapes ``priortr.tools.flops`` reads.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig
from transformers.utils import logging as hf_logging

SOURCES: dict[str, str] = {
    "llava-1.5-7b": "llava-hf/llava-1.5-7b-hf",
    "llava-1.5-13b": "llava-hf/llava-1.5-13b-hf",
    "qwen2.5-vl-7b": "Qwen/Qwen2.5-VL-7B-Instruct",
}


def shipped_configs() -> list[str]:
    """Names accepted by ``load_config`` besides paths, sorted."""
    return sorted(SOURCES)


def config_dict(name: str) -> dict[str, Any]:
    """The shipped ``config.json`` content of ``name``, as a fresh dict."""
    if name not in SOURCES:
        raise ValueError(f"unknown config {name!r}; shipped configs: {', '.join(shipped_configs())}")
    text = resources.files(__name__).joinpath(f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text)


def load_config(name_or_path: str) -> PretrainedConfig:
    """A new ``PretrainedConfig`` from a shipped name, a checkpoint directory, or a ``config.json`` file.

    Shipped names go through the model type's own config class (``AutoConfig.for_model``); a path goes
    through ``AutoConfig.from_pretrained`` and is read locally only. Anything else raises ``ValueError``
    naming the shipped configs. Every call returns a new object, so callers may change it.
    """
    if name_or_path in SOURCES:
        data = config_dict(name_or_path)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the hub files' legacy ``rope_scaling`` keys warn on v5
        try:
            return AutoConfig.for_model(**data)
        finally:
            hf_logging.set_verbosity(verbosity)
    path = Path(name_or_path)
    if (path.is_dir() and (path / "config.json").is_file()) or path.is_file():
        try:
            return AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"cannot read a transformers config from {name_or_path!r}: {exc}") from exc
    raise ValueError(
        f"unknown config {name_or_path!r}: not a local checkpoint directory or config.json file, "
        f"nor one of the shipped configs: {', '.join(shipped_configs())}"
    )


__all__ = ["SOURCES", "config_dict", "load_config", "shipped_configs"]
