"""Write the model ``scripts/gpu-check.sh --tiny`` runs: the LLaVA-1.5-7B config, smaller.

    python scripts/tiny_model.py DIR        (writes DIR/config.json; gpu-check.sh passes DIR as --model)

Sizes only: 4 decoder layers (the scored layer, 2, keeps a layer after it), 1 vision layer, and a
language model 4 times narrower (hidden 1024, 8 heads of the model's head size 128, MLP 2752). The
family, the image size and so the 576 visual tokens per image, the vocabulary and every step of the
script are the full model's; the language model's float32 prefill costs about 1/16 of the 4-layer
full-width one, so the CPU run fits CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

from priortr.tools.bench import bench_config

MODEL = "llava-1.5-7b"
LAYERS, VISION_LAYERS, NARROWER = 4, 1, 4


def tiny_config():
    """``MODEL``'s config at ``LAYERS`` / ``VISION_LAYERS`` layers, its language model ``NARROWER``
    times narrower (heads fewer, each of the same size)."""
    config = bench_config(MODEL, LAYERS, VISION_LAYERS)
    text = config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    text.hidden_size //= NARROWER
    text.intermediate_size //= NARROWER
    text.num_attention_heads = text.num_key_value_heads = text.hidden_size // head_dim
    return config


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/tiny_model.py DIR")
    directory = Path(sys.argv[1])
    tiny_config().save_pretrained(directory)
    print(f"tiny {MODEL}: {directory / 'config.json'}")


if __name__ == "__main__":
    main()
