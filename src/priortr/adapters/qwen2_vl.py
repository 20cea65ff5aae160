"""Qwen2-VL and Qwen2.5-VL: dynamic-resolution images between ``<|vision_start|>`` and
``<|vision_end|>``; the separator is ``<|vision_end|>``. Positions are M-RoPE: ``generate()`` passes
``[4, B, S]`` ids (row 0 text positions, rows 1-3 temporal/height/width)."""

import torch
from torch import nn

from priortr.adapters.base import FamilyAdapter


class QwenVLAdapter(FamilyAdapter):
    name = "qwen2-vl"
    model_types = ("qwen2_vl", "qwen2_5_vl")
    separator_token = "<|vision_end|>"

    def visual_token_ids(self, config) -> dict[str, int]:
        return {"image": config.image_token_id, "video": config.video_token_id}

    def text_positions(self, model: nn.Module, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """Row 0 of ``[4, B, S]`` ids; M-RoPE-only ``[1 or 3, B, S]`` ids (a later chat turn) are text
        positions shifted by the prefill's ``rope_deltas``."""
        if position_ids is None or position_ids.ndim == 2:
            return position_ids
        if position_ids.ndim == 3 and position_ids.shape[0] == 4:
            return position_ids[0]
        if position_ids.ndim == 3 and position_ids.shape[0] in (1, 3):
            return position_ids[0] - self.multimodal_model(model).rope_deltas.to(position_ids.device)
        raise ValueError(
            "Qwen-VL position ids must be [4, B, S], [3, B, S], [1, B, S] or [B, S]; "
            f"got shape {tuple(position_ids.shape)}"
        )

    def continuation_position_ids(self, model: nn.Module, text_positions: torch.Tensor) -> torch.Tensor:
        deltas = self.multimodal_model(model).rope_deltas  # [B, 1], set by the prefill
        mrope = (text_positions + deltas.to(text_positions.device))[None].expand(3, -1, -1)
        return torch.cat([text_positions[None], mrope], dim=0)  # [4, B, S]

    def vision_modules(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        visual = self.multimodal_model(model).visual  # patch embedding, blocks and merger
        return visual, visual
