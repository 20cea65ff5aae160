"""Qwen2-VL and Qwen2.5-VL: dynamic-resolution images between ``<|vision_start|>`` and
``<|vision_end|>``; the separator is ``<|vision_end|>``. Positions are M-RoPE: ``generate()`` passes
``[4, B, S]`` ids (row 0 text positions, rows 1-3 temporal/height/width)."""

import torch
from torch import nn

from priortr.adapters.base import FamilyAdapter, prompt_layout


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

    def dummy_inputs(self, config, batch: int, text_tokens: int, generator: torch.Generator) -> dict:
        """A 672x672 image: a 48x48 patch grid merged 2x2 into 576 tokens, as LLaVA-1.5's budget scale."""
        vision = config.vision_config
        grid = (1, 48, 48)
        n_visual = grid[1] * grid[2] // vision.spatial_merge_size**2
        limit = config.vision_start_token_id
        ids = prompt_layout(config.image_token_id, n_visual, text_tokens, limit, batch, generator)
        start = ids.new_full((batch, 1), config.vision_start_token_id)
        end = ids.new_full((batch, 1), config.vision_end_token_id)
        ids = torch.cat([ids[:, :3], start, ids[:, 4 : 4 + n_visual], end, ids[:, 5 + n_visual :]], dim=1)
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(batch * grid[1] * grid[2], patch, generator=generator),
            "image_grid_thw": torch.tensor([grid] * batch),
            "mm_token_type_ids": (ids == config.image_token_id).long(),
        }

    def visual_grid(self, config, inputs: dict, row: int) -> tuple[int, int]:
        """``(h // merge, w // merge)`` from ``inputs["image_grid_thw"][row]`` (one image per prompt, so the
        row's image); merged tokens come in raster order, as their M-RoPE height/width ids say."""
        grid = inputs.get("image_grid_thw")
        if grid is None:
            raise ValueError("the inputs hold no image_grid_thw, so the image's token grid is unknown")
        frames, height, width = (int(v) for v in grid[row])
        if frames != 1:
            raise ValueError(f"an image has one temporal patch; got a {frames}-frame grid")
        merge = config.vision_config.spatial_merge_size
        return height // merge, width // merge

    def image_view(self, image, processor):
        """The whole image: ``smart_resize`` keeps the aspect ratio (to a multiple of 28 px) and nothing is
        cropped, so the grid spans the whole image."""
        return image
