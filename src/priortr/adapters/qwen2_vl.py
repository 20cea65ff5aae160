"""Qwen2-VL and Qwen2.5-VL: dynamic-resolution images between ``<|vision_start|>`` and
``<|vision_end|>``; the separator is ``<|vision_end|>``. Positions are M-RoPE: ``generate()`` passes
``[4, B, S]`` ids (row 0 text positions, rows 1-3 temporal/height/width)."""

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from priortr.adapters.base import FamilyAdapter, VisualItem
from priortr.tensors.host import to_host


class QwenVLAdapter(FamilyAdapter):
    name = "qwen2-vl"
    model_types = ("qwen2_vl", "qwen2_5_vl")
    separator_token = "<|vision_end|>"
    token_grids = True

    def item_grids(
        self, model_config, items: list[VisualItem], arguments: Mapping[str, Any]
    ) -> list[VisualItem]:
        """Every image on its merged patch grid, (h // m, w // m) of its row of ``image_grid_thw``
        (images in batch and prompt order, m the vision config's ``spatial_merge_size``): the merged
        tokens come row-major, as their M-RoPE height and width ids say. Videos are refused. A call of
        ``generate()`` that encoded the images before the prefill (``mm_encoder_outputs``, transformers
        5.2x) passes no ``image_grid_thw``: the grids are then read from its M-RoPE position ids."""
        grids = arguments.get("image_grid_thw")
        images = [item for item in items if item.modality == "image"]
        if len(images) != len(items):
            raise ValueError(
                "a method that filters on the token grid takes images only; this prompt has a video"
            )
        positions = arguments.get("position_ids")
        if grids is None and positions is not None and positions.ndim == 3 and positions.shape[0] in (3, 4):
            return [replace(item, grid=self._grid_from_positions(item, positions)) for item in items]
        if grids is None or len(grids) != len(images):
            found = "no image_grid_thw" if grids is None else f"{len(grids)} rows of image_grid_thw"
            raise ValueError(
                f"the call has {found} for its {len(images)} images, so their token grids are unknown"
            )
        out = []
        for item, grid_thw in zip(items, grids.tolist(), strict=True):
            grid = self.image_grid(model_config, grid_thw)
            if grid[0] * grid[1] != item.size:
                raise ValueError(
                    f"an image of {item.size} tokens has image_grid_thw {tuple(grid_thw)}, which does not "
                    f"lay them out on one {grid[0]} x {grid[1]} grid"
                )
            out.append(replace(item, grid=grid))
        return out

    @staticmethod
    def _grid_from_positions(item: VisualItem, positions: torch.Tensor) -> tuple[int, int]:
        """(rows, columns) of an image from its tokens' M-RoPE height and width ids (the last two rows of
        ``positions`` [3 or 4, B, S]), which count its merged grid's rows and columns from one offset."""
        (ids,) = to_host(positions[-2:, item.row].index_select(-1, item.positions.to(positions.device)))
        grid = tuple(int(axis.max() - axis.min()) + 1 for axis in ids)
        if grid[0] * grid[1] != item.size:
            raise ValueError(
                f"an image of {item.size} tokens has M-RoPE ids over a {grid[0]} x {grid[1]} grid, which "
                "does not lay them out on one grid"
            )
        return grid

    def visual_token_ids(self, config) -> dict[str, int]:
        return {"image": config.image_token_id, "video": config.video_token_id}

    def image_grid(self, config, grid_thw: Sequence[int] | torch.Tensor) -> tuple[int, int]:
        """(rows, columns) of an image's visual tokens, which come in raster order as their M-RoPE
        height/width ids say, from its patch grid ``grid_thw`` (its row of the processor's
        ``image_grid_thw``): the patches merged ``spatial_merge_size`` x ``spatial_merge_size``. The one
        rule for ``item_grids``, the tools' score maps and the vLLM plug-in's positions."""
        frames, height, width = (int(v) for v in grid_thw)
        if frames != 1:
            raise ValueError(f"an image has one temporal patch; got a {frames}-frame grid")
        merge = config.vision_config.spatial_merge_size
        return height // merge, width // merge

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
