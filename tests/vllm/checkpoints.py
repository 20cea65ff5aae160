"""Tiny random-weight LLaVA, Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints that vLLM's CPU build can
load, built offline.

vLLM's CPU attention takes head sizes 32, 64, 80, ... only, so the text models here have hidden size
128 over 4 heads (head_dim 32). The weights are drawn wider than transformers' default (std 0.02)
so that greedy tokens depend visibly on which visual tokens are kept, and near-ties between the two
engines' float32 logits are unlikely.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from tests.helpers import checkpoint
from tests.helpers.tiny import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    QWEN_IMAGE_ID,
    QWEN_VIDEO_ID,
    QWEN_VISION_END_ID,
    QWEN_VISION_START_ID,
    VOCAB,
    tiny_qwen2_5_vl,
    tiny_qwen2_vl,
)
from tests.helpers.tiny_qwen3_vl import tiny_qwen3_vl, tiny_qwen3_vl_moe

TEXT = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
QWEN_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}  # sums to 32 / 2
QWEN3_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [6, 5, 5],
    "mrope_interleaved": True,
}
WEIGHT_STD = 0.08
QWEN_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: "
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)


def _widen(path: Path, seed: int, vision: tuple[str, ...] = ()) -> None:
    """Redraw the language model's and projector's matrices with std ``WEIGHT_STD`` (norms untouched),
    and the vision tower's whose names hold one of ``vision``, and name a CLIP tower's weights as the
    llava-hf checkpoints do (``vision_tower.vision_model.*``, which vLLM's loader expects and
    transformers reads too)."""
    file = path / "model.safetensors"
    weights = load_file(file)
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in weights.items():
        tower = "vision_tower" in name or "visual" in name
        if value.ndim == 2 and (not tower or any(part in name for part in vision)):
            value = torch.randn(value.shape, generator=generator) * WEIGHT_STD
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        out[name] = value
    save_file(out, file, metadata={"format": "pt"})


def llava(path: str | Path) -> Path:
    """LLaVA-1.5 (CLIP tower, 16 visual tokens per 28x28 image) with a 4-layer head_dim-32 Llama."""
    original = checkpoint.tiny_llava
    checkpoint.tiny_llava = lambda dtype: original(dtype=dtype, text=TEXT)
    try:
        path = checkpoint.save_tiny_llava_checkpoint(path)
    finally:
        checkpoint.tiny_llava = original
    _widen(path, seed=1)
    return path


def qwen2_vl(path: str | Path) -> Path:
    """Qwen2-VL with a 4-layer head_dim-32 text model; a 56x56 image is 4 visual tokens, 112x112 is 16."""
    return _qwen(Path(path), tiny_qwen2_vl, "hidden_size", Qwen2VLProcessor, seed=2)


def qwen2_5_vl(path: str | Path) -> Path:
    """Qwen2.5-VL (windowed vision blocks) with the same text model and image sizes as ``qwen2_vl``."""
    return _qwen(Path(path), tiny_qwen2_5_vl, "out_hidden_size", Qwen2_5_VLProcessor, seed=3)


def qwen3_vl(path: str | Path) -> Path:
    """Qwen3-VL with a 4-layer head_dim-32 text model (q/k norms, interleaved M-RoPE) and DeepStack
    features added to the outputs of decoder layers 0 and 1 (``tests.helpers.tiny_qwen3_vl``); patches
    of 16 px, so a 64x64 image is 4 visual tokens and 128x128 is 16. The DeepStack mergers are drawn
    wide too: at transformers' default std the features are too small to change a greedy answer."""
    return _qwen(
        Path(path),
        tiny_qwen3_vl,
        "out_hidden_size",
        Qwen3VLProcessor,
        seed=4,
        patch=16,
        vision=("deepstack_merger_list",),
        text={"head_dim": TEXT["hidden_size"] // TEXT["num_attention_heads"], "rope_parameters": QWEN3_ROPE},
        video=lambda low, high: Qwen3VLVideoProcessor(size={"shortest_edge": low, "longest_edge": high}),
    )


def qwen3_vl_moe(path: str | Path) -> Path:
    """Qwen3-VL MoE, laid out as ``qwen3_vl``: a family the plug-in does not serve."""
    return _qwen(
        Path(path),
        tiny_qwen3_vl_moe,
        "out_hidden_size",
        Qwen3VLProcessor,
        seed=5,
        patch=16,
        text={"head_dim": TEXT["hidden_size"] // TEXT["num_attention_heads"], "rope_parameters": QWEN3_ROPE},
        video=lambda low, high: Qwen3VLVideoProcessor(size={"shortest_edge": low, "longest_edge": high}),
    )


def _qwen(
    path: Path,
    build: Callable,
    merger_width: str,
    processor_class: type,
    seed: int,
    patch: int = 14,
    text: dict[str, Any] | None = None,
    video: Callable[[int, int], Any] = lambda low, high: Qwen2VLVideoProcessor(
        min_pixels=low, max_pixels=high
    ),
    vision: tuple[str, ...] = (),
) -> Path:
    """A tiny Qwen-VL of ``build`` with the head_dim-32 text model (``text`` adds to or replaces its
    settings); ``merger_width`` names the vision config's output width (the text width); images are
    resized to 4x4 .. 8x8 patches of ``patch`` px; ``vision``: as ``_widen``'s."""
    path.mkdir(parents=True, exist_ok=True)
    model = build(dtype=torch.float32)
    config = model.config
    for key, value in {**TEXT, "rope_parameters": QWEN_ROPE, **(text or {})}.items():
        setattr(config.text_config, key, value)
    setattr(config.vision_config, merger_width, TEXT["hidden_size"])
    torch.manual_seed(0)
    model = type(model)._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.save_pretrained(path)
    low, high = (4 * patch) ** 2, (8 * patch) ** 2
    processor = processor_class(
        image_processor=Qwen2VLImageProcessorPil(patch_size=patch, min_pixels=low, max_pixels=high),
        video_processor=video(low, high),
        tokenizer=_qwen_tokenizer(),
        chat_template=QWEN_TEMPLATE,
    )
    processor.save_pretrained(path)
    _widen(path, seed=seed, vision=vision)
    return path


def _qwen_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer whose vision tokens have the tiny Qwen config's ids."""
    special = {
        "<pad>": PAD_ID,
        "<s>": BOS_ID,
        "</s>": EOS_ID,
        "<unk>": 3,
        "\n": 4,
        "<|vision_start|>": QWEN_VISION_START_ID,
        "<|vision_end|>": QWEN_VISION_END_ID,
        "<|video_pad|>": QWEN_VIDEO_ID,
        "<|image_pad|>": QWEN_IMAGE_ID,
    }
    free = [i for i in range(VOCAB) if i not in special.values()]
    words = [*checkpoint.WORDS, "USER:", "ASSISTANT:"]
    vocab = special | dict(zip(words + [f"w{i}" for i in free[len(words) :]], free, strict=True))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>",
        },
    )
    tokenizer.add_tokens(["\n"])
    vision = ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|image_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": vision})
    return tokenizer
