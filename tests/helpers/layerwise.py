"""Run a tiny LLaVA's (or Qwen-VL's) language model one decoder layer at a time, dropping tokens
between layers as the authors' code of an in-LLM pruning method does, so that tests can restate that
code independently of the library's engine (tests/methods/test_official_*.py).

The language model is driven with its own modules (decoder layers, rotary embedding, norms) on the
input embeddings the multimodal model builds (with a Qwen-VL model's M-RoPE ids, when given); each kept
token keeps its original RoPE position (the library's harness rule for every method, docs/methods.md).
Needs an eager-attention float64 model, so the explicit additive causal mask is what every layer
applies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from tests.helpers.tiny import Batch


def input_embeddings(model, batch: Batch) -> torch.Tensor:
    """[1, S, D] the language model's input embeddings (image features already in place)."""
    captured = {}

    def grab(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]

    handle = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**batch.kwargs())
    finally:
        handle.remove()
    return captured["embeds"]


def causal_mask(length: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, L, L] additive causal mask."""
    blocked = torch.ones(length, length, dtype=torch.bool).triu(1)
    return torch.zeros(length, length, dtype=dtype).masked_fill(blocked, float("-inf"))[None, None]


def projections(layer, hidden: torch.Tensor, positions: torch.Tensor, rotary) -> tuple[torch.Tensor, ...]:
    """Post-RoPE queries [H, S, d] and keys [H, S, d] (kv heads repeated) of decoder ``layer`` applied
    to its input ``hidden`` [1, S, D] at prompt ``positions`` [S]."""
    attention = layer.self_attn
    normed = layer.input_layernorm(hidden)
    head_dim = attention.head_dim
    queries = attention.q_proj(normed).view(1, hidden.shape[1], -1, head_dim).transpose(1, 2)
    keys = attention.k_proj(normed).view(1, hidden.shape[1], -1, head_dim).transpose(1, 2)
    cos, sin = rotary(hidden, positions[None])
    queries, keys = apply_rotary_pos_emb(queries, keys, cos, sin)
    keys = repeat_kv(keys, queries.shape[1] // keys.shape[1])
    return queries[0], keys[0]


Drop = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]
"""(layer index, hidden after that layer [1, S', D], layer input [1, S', D], kept positions [S']) ->
positions to keep from now on, or None to keep all."""


@torch.no_grad()
def run_layers(model, batch: Batch, drop: Drop, rope: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Run the language model layer by layer on batch row 0; after each layer ``drop`` may shorten the
    sequence. ``rope``: M-RoPE position ids [3, 1, S] of the prompt (Qwen-VL; None: 0 .. S-1).
    Returns the kept positions after every layer."""
    language_model = model.model.language_model
    hidden = input_embeddings(model, batch)
    kept = torch.arange(hidden.shape[1])
    history = []
    for index, layer in enumerate(language_model.layers):
        cos, sin = language_model.rotary_emb(hidden, kept[None] if rope is None else rope[..., kept])
        layer_input = hidden
        hidden = layer(
            hidden,
            attention_mask=causal_mask(kept.numel(), hidden.dtype),
            position_ids=kept[None],
            position_embeddings=(cos, sin),
        )
        survivors = drop(index, hidden, layer_input, kept)
        if survivors is not None:
            columns = torch.searchsorted(kept, survivors)
            hidden, kept = hidden[:, columns], survivors
        history.append(kept)
    return history
