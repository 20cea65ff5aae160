"""Qwen3-VL (dense and MoE): Qwen2-VL's prompt layout and M-RoPE position ids, plus q/k norms and DeepStack.

* Images are ``<|vision_start|> <|image_pad|> x N <|vision_end|>``, as in Qwen2-VL. A video is written frame
  by frame (one frame = one temporal patch): ``<t seconds> <|vision_start|> <|video_pad|> x n <|vision_end|>``
  per frame (``Qwen3VLProcessor.replace_video_token``), the whole inside the chat template's own
  ``<|vision_start|> ... <|vision_end|>`` in transformers 5 (its processors expand only the ``<|video_pad|>``
  of the template's ``<|vision_start|><|video_pad|><|vision_end|>``). So every frame is one run of
  placeholders, an item of its own (the default ``visual_items``) whose separator is its ``<|vision_end|>``;
  ``get_rope_index`` splits ``video_grid_thw`` the same way, one ``(1, h, w)`` M-RoPE grid per frame.
* Position ids are Qwen2-VL's: ``generate()`` passes ``[4, B, S]`` (text row + the three M-RoPE rows) at
  prefill and decode, and ``[1, B, S]`` text positions plus ``rope_deltas`` when a later turn continues a
  cache. Only the rotary embedding differs (interleaved T/H/W frequencies), which the layer's
  ``position_embeddings`` already carry.
* Decoder attention applies ``q_norm`` / ``k_norm`` (RMSNorm over each head) to the projections before RoPE.
* DeepStack: the text model adds the vision tower's intermediate features to the visual positions of the
  outputs of its first decoder layers, one layer per feature (``Qwen3VLTextModel._deepstack_process``).

The benchmark prompt (``priortr.tools.families.dummy_inputs``, Qwen2-VL's) is a 48x48 patch grid, 576
tokens: a 768x768 image at 16 px patches.
"""

import torch
from torch import nn

from priortr.adapters.qwen2_vl import QwenVLAdapter


class Qwen3VLAdapter(QwenVLAdapter):
    name = "qwen3-vl"
    model_types = ("qwen3_vl", "qwen3_vl_moe")

    def queries_and_keys(
        self, attention: nn.Module, query_out: torch.Tensor, key_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head ``q_norm(q)`` [B, H, S, d] and ``k_norm(k)`` [B, H_kv, S, d], as
        ``Qwen3VLTextAttention.forward`` computes them before RoPE."""
        head_dim = attention.head_dim
        queries = attention.q_norm(query_out.view(*query_out.shape[:2], -1, head_dim)).transpose(1, 2)
        keys = attention.k_norm(key_out.view(*key_out.shape[:2], -1, head_dim)).transpose(1, 2)
        return queries, keys

    def injected_layers(self, model: nn.Module) -> int:
        """``deepstack_layers`` of the model's vision config and decoder layers."""
        return deepstack_layers(model.config.vision_config, len(self.decoder_layers(model)))


def deepstack_layers(vision_config: object, n_layers: int) -> int:
    """One decoder layer per DeepStack feature: the vision tower emits a feature after each block listed
    in ``deepstack_visual_indexes`` (each block once, indexes outside ``[0, depth)`` never match) and the
    text model adds feature ``i`` to the output of decoder layer ``i`` (of ``n_layers``). A function of
    the config, so that the vLLM plug-in refuses what ``apply`` refuses before it builds a model."""
    blocks = {index for index in vision_config.deepstack_visual_indexes if 0 <= index < vision_config.depth}
    return min(len(blocks), n_layers)
