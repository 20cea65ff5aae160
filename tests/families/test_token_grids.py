"""The token grid of an image, which the adapter owns and both the tools' score maps
(``tools.families.visual_grid``) and the vLLM plug-in's positions read: hand-computed on stand-in
configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from priortr.adapters import Mistral3Adapter, Qwen3VLAdapter, QwenVLAdapter


@pytest.mark.parametrize("adapter", [QwenVLAdapter(), Qwen3VLAdapter()])
def test_qwen_grid_is_the_patch_grid_merged(adapter):
    config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2))
    assert adapter.token_grid(config, (1, 6, 8)) == (3, 4)
    with pytest.raises(ValueError, match="2-frame grid"):
        adapter.token_grid(config, (2, 6, 8))  # a video's grid is not an image's


def test_pixtral_grid_is_the_resized_pixels_over_a_token():
    """Mistral Small 3.1: 14 px patches merged 2 x 2, so 28 px a token: 672 x 448 px is 24 x 16."""
    config = SimpleNamespace(vision_config=SimpleNamespace(patch_size=14), spatial_merge_size=2)
    assert Mistral3Adapter().token_grid(config, 672, 448) == (24, 16)
