"""The token grid of an image, one rule per family in its adapter (``image_grid``), which the engine's
``item_grids`` (Qwen), the tools' score maps (``tools.families.visual_grid``) and the vLLM plug-in's
positions all read: hand-computed on stand-in configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from priortr.adapters import Mistral3Adapter, Qwen3VLAdapter, QwenVLAdapter
from priortr.adapters.base import VisualItem
from priortr.tools import families


@pytest.mark.parametrize("adapter", [QwenVLAdapter(), Qwen3VLAdapter()])
def test_qwen_grid_is_the_patch_grid_merged(adapter):
    """6 x 8 patches merged 2 x 2: 3 x 4 tokens, by every reader."""
    config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2))
    assert adapter.image_grid(config, (1, 6, 8)) == (3, 4)
    grids = torch.tensor([[1, 6, 8]])
    assert families.visual_grid(adapter, config, {"image_grid_thw": grids}, 0) == (3, 4)
    (item,) = adapter.item_grids(config, [VisualItem(0, torch.arange(2, 14), 14)], {"image_grid_thw": grids})
    assert item.grid == (3, 4)
    with pytest.raises(ValueError, match="2-frame grid"):
        adapter.image_grid(config, (2, 6, 8))  # a video's grid is not an image's


def test_pixtral_grid_is_the_resized_pixels_over_a_token():
    """Mistral Small 3.1: 14 px patches merged 2 x 2, so 28 px a token: 672 x 448 px is 24 x 16."""
    config = SimpleNamespace(vision_config=SimpleNamespace(patch_size=14), spatial_merge_size=2)
    assert Mistral3Adapter().pixel_grid(config, 672, 448) == (24, 16)
    sizes = torch.tensor([[672, 448]])
    assert families.visual_grid(Mistral3Adapter(), config, {"image_sizes": sizes}, 0) == (24, 16)
