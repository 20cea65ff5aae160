"""Print what pruning adds to a prefill and a decode step: ops, host syncs, hook calls, host time.

    .venv/bin/python benchmarks/overhead.py [--layers 32] [--methods priortr fastv pdrop divprune]
        [--budget 4] [--layer 2] [--batch 1] [--cache dynamic static] [--compile]

The model is a tiny LLaVA with random weights (a 32-layer Llama of width 64, a 2-layer CLIP tower, one
28 x 28 image = 16 visual tokens), so transformers' own work is what a real model's is in number of
ops, and everything the library adds is visible. Counts are exact and machine-independent; host
times are medians on this machine with one thread (``priortr.tools.overhead``).
"""

from __future__ import annotations

import argparse

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from priortr.tools import overhead

IMAGE_ID = 199


def tiny_llava(layers: int) -> LlavaForConditionalGeneration:
    text = LlamaConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = CLIPVisionConfig(
        image_size=28,
        patch_size=7,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE_ID, image_seq_length=16, pad_token_id=0
    )
    torch.manual_seed(0)
    return LlavaForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()


def inputs(batch: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(3, 190, (batch, 12), generator=generator)
    ids = torch.cat([text[:, :4], torch.full((batch, 16), IMAGE_ID), text[:, 4:]], dim=1)
    pixels = torch.randn(batch, 3, 28, 28, generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--methods", nargs="+", default=["priortr", "fastv", "pdrop", "divprune"])
    parser.add_argument("--budget", type=int, default=4)
    parser.add_argument("--layer", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cache", nargs="+", default=["dynamic", "static"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--compile", action="store_true", help="also count compiled decode graphs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = tiny_llava(args.layers)
    batch = inputs(args.batch)
    for cache in args.cache:
        for method in args.methods:
            layer = args.layer if priortr_method_takes_layer(method) else None
            result = overhead.measure(
                model,
                batch,
                repeats=args.repeats,
                generate_kwargs={"cache_implementation": cache},
                method=method,
                budget=args.budget,
                layer=layer,
            )
            print(f"\n### {method}, {cache} cache, batch {args.batch}, K={args.budget} of 16\n")
            print(result.markdown())
            print(f"\npruned prefill syncs by kind: {dict(result.prefill.sync_names)}")
    if args.compile:
        vanilla = overhead.count_compiled_graphs(model, batch)
        print(f"\ncompiled decode (static cache, fullgraph=True): vanilla {vanilla} graph(s)")
        for method in args.methods:
            import priortr

            layer = args.layer if priortr_method_takes_layer(method) else None
            with priortr.apply(model, method=method, budget=args.budget, layer=layer):
                print(f"  {method}: {overhead.count_compiled_graphs(model, batch)} graph(s)")


def priortr_method_takes_layer(method: str) -> bool:
    import priortr

    return priortr.get_method(method).where == "layer"


if __name__ == "__main__":
    main()
