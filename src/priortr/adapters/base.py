"""What the pruning engine needs to know about a model family, and nothing else.

An adapter declares where a family keeps its language model, its decoder layers and its attention
projections, which token ids mark visual tokens, and how the family writes position ids. The engine
owns every tensor operation; adding a family means a new adapter module, never an engine change.
"""

from __future__ import annotations

import torch
from torch import nn


class FamilyAdapter:
    """Base adapter: the defaults fit a ``*ForConditionalGeneration`` whose ``.model`` holds a
    ``language_model`` with ``.layers``, each with ``self_attn.{q,k}_proj`` (LLaVA, Qwen-VL).

    A family overrides only what differs: ``name``, ``model_types``, ``visual_token_ids`` and, if its
    position ids are not plain ``[B, S]`` text positions, ``text_positions`` /
    ``continuation_position_ids``.
    """

    name: str = ""
    model_types: tuple[str, ...] = ()
    separator_token: str = "the first token after the image"

    def multimodal_model(self, model: nn.Module) -> nn.Module:
        """The module whose forward receives ``input_ids``, the masks and the cache (``model.model``)."""
        return model.model

    def language_model(self, model: nn.Module) -> nn.Module:
        return self.multimodal_model(model).language_model

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return self.language_model(model).layers

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn

    def query_projection(self, attention: nn.Module) -> nn.Module:
        return attention.q_proj

    def key_projection(self, attention: nn.Module) -> nn.Module:
        return attention.k_proj

    def visual_token_ids(self, config) -> dict[str, int]:
        """Token ids of visual placeholders, by modality name; only ``image`` is pruned today."""
        return {"image": config.image_token_id}

    def text_positions(self, model: nn.Module, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """The 1-D text positions ``[B or 1, S]`` inside whatever the family passes as position ids."""
        return position_ids

    def continuation_position_ids(self, model: nn.Module, text_positions: torch.Tensor) -> torch.Tensor:
        """Position ids to pass when continuing a pruned cache without any from the caller.

        The model would derive them from the cache length, which pruning shortened.
        """
        return text_positions

    def queries_and_keys(
        self, attention: nn.Module, query_out: torch.Tensor, key_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head queries [B, H, S, d] and keys [B, H_kv, S, d] from the projections' outputs, before
        RoPE. Families with q/k norms (Qwen3) apply them here."""
        head_dim = attention.head_dim
        batch, seq, _ = query_out.shape
        queries = query_out.view(batch, seq, -1, head_dim).transpose(1, 2)
        keys = key_out.view(batch, seq, -1, head_dim).transpose(1, 2)
        return queries, keys
