"""Gemma 4 (``Gemma4ForConditionalGeneration``): the dense shape, the on-device E2B/E4B shape and the MoE,
one text model of sliding-window and global attention layers behind a vision tower that pools its
patches to the caller's number of tokens per image (70-1120: the processor's ``max_soft_tokens``).

* An image is ``<|image> <|image|> x N <image|>`` (``Gemma4Processor.replace_image_token``), a video frame
  ``<|image> <|video|> x N <image|>`` after its timestamp; the separator is ``<image|>``. N is read from
  the prompt (each run of a placeholder id is one item). With ``use_bidirectional_attention="vision"``
  the tokens of one image attend to each other in both directions on the sliding-window layers only
  (``create_masks_for_vision_model``; global layers stay causal), at prefill; the engine gathers those
  masks as the model built them.
* Attention applies ``q_norm`` / ``k_norm`` per head before RoPE and does not scale its scores
  (``scaling`` = 1). Global layers have their own head size and KV head count
  (``config.per_layer_config``), may reuse their keys as values (``attention_k_eq_v``) and rotate a
  part of each head (proportional RoPE: the unrotated dimensions get cos 1, sin 0); each layer's
  attention module carries its own ``head_dim``, and its call its own ``(cos, sin)``.
* The E2B/E4B shape adds per-layer inputs (a ``[B, S, layers, d]`` tensor made before layer 0, one slice
  per decoder layer's call: the engine cuts it with the hidden states, ``compat.calls``) and shares KV:
  the last ``num_kv_shared_layers`` layers have no key projection and read the keys and values the last
  earlier layer of their type stored in the forward's ``shared_kv_states``. They cannot be scored
  (``scored_layers``); the engine cuts the stored states with the cache (``kv_shared_layers``).
* Position ids are plain ``[B, S]`` text positions (the base class's handling).
"""

import torch
from torch import nn

from priortr.adapters.base import FamilyAdapter


class Gemma4Adapter(FamilyAdapter):
    name = "gemma4"
    model_types = ("gemma4",)
    separator_token = "<image|>"

    def visual_token_ids(self, config) -> dict[str, int]:
        return {"image": config.image_token_id, "video": config.video_token_id}

    def kv_shared_layers(self, model: nn.Module) -> dict[int, str]:
        """Layer index -> the key of ``shared_kv_states`` its attention reads (its layer type), for the
        layers that reuse an earlier layer's keys and values."""
        return {
            index: layer.self_attn.layer_type
            for index, layer in enumerate(self.decoder_layers(model))
            if layer.self_attn.is_kv_shared_layer
        }

    def scored_layers(self, model: nn.Module) -> list[int]:
        """Every layer with its own key projection: the KV-shared layers have none to recompute."""
        shared = self.kv_shared_layers(model)
        return [index for index in self.attention_layers(model) if index not in shared]

    def queries_and_keys(
        self, attention: nn.Module, query_out: torch.Tensor, key_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head ``q_norm(q)`` [B, H, S, d] and ``k_norm(k)`` [B, H_kv, S, d], as ``Gemma4TextAttention``
        (with the layer's own head size)."""
        queries, keys = super().queries_and_keys(attention, query_out, key_out)
        return attention.q_norm(queries), attention.k_norm(keys)

    def vision_modules(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        multimodal = self.multimodal_model(model)
        return multimodal.vision_tower, multimodal.embed_vision
