"""Qwen3.5 (dense and MoE): a hybrid decoder of Gated DeltaNet linear-attention layers and gated
full-attention layers (three linear layers to one full layer in the released models), with Qwen3-VL's
prompt layout and M-RoPE position ids and no DeepStack.

* Only full-attention layers (``config.layer_types[i] == "full_attention"``) have attention rows; a
  linear-attention layer keeps a fixed-size recurrent state and a short convolution state per sequence,
  no per-token keys. ``attention_layers`` lists the full-attention layers, the only ones a method can
  score (``priortr.apply`` refuses the others and names the nearest allowed one).
* A full-attention layer's ``q_proj`` yields, per head, the query and an output gate side by side
  (``Qwen3_5Attention.forward``: ``view(..., -1, 2 * head_dim)`` then ``chunk(2)``); only the query half is
  attention evidence. ``q_norm`` / ``k_norm`` act per head before RoPE, which rotates the first quarter of
  each head (``partial_rotary_factor``), as the base class's RoPE handles.
* Prompt layout and position ids: ``QwenVLAdapter`` / ``Qwen3VLAdapter`` (images and video frames as runs of
  placeholders closed by ``<|vision_end|>``; ``[4, B, S]`` ids at prefill and decode).
"""

import torch
from torch import nn

from priortr.adapters.qwen3_vl import Qwen3VLAdapter


class Qwen3_5Adapter(Qwen3VLAdapter):
    name = "qwen3.5"
    model_types = ("qwen3_5", "qwen3_5_moe")

    def attention_layers(self, model: nn.Module) -> list[int]:
        layer_types = model.config.get_text_config().layer_types
        return [index for index, kind in enumerate(layer_types) if kind == "full_attention"]

    def queries_and_keys(
        self, attention: nn.Module, query_out: torch.Tensor, key_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head ``q_norm(query)`` [B, H, S, d] (the query half of each head's ``[query | gate]``) and
        ``k_norm(k)`` [B, H_kv, S, d]."""
        head_dim = attention.head_dim
        query, _ = query_out.view(*query_out.shape[:2], -1, 2 * head_dim).chunk(2, dim=-1)
        queries = attention.q_norm(query).transpose(1, 2)
        keys = attention.k_norm(key_out.view(*key_out.shape[:2], -1, head_dim)).transpose(1, 2)
        return queries, keys

    def injected_layers(self, model: nn.Module) -> int:
        """None: Qwen3.5's vision tower adds no DeepStack features to the decoder layers."""
        return 0
