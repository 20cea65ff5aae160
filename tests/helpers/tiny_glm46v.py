"""A tiny GLM-4.6V, as the stock ``Glm46VConfig`` builds it: GLM-4.1V's vision tower under either text
model the config names, the dense ``glm4v_text`` (its default) or the MoE ``glm4v_moe_text``.

The prompt layout and ids are GLM-4.1V's (``tests.helpers.tiny_glm4v``): ``Glm46VProcessor`` writes an image
as ``<|begin_of_image|> <|image|> x N <|end_of_image|>`` and a video frame by frame with the *image*
placeholder, each frame followed by its ``"{t:.1f} seconds"`` timestamp (a few text tokens here); the
batch builders of ``tiny_glm4v`` serve it unchanged.
"""

from __future__ import annotations

import torch
from transformers import Glm46VConfig, Glm46VForConditionalGeneration

from tests.helpers.tiny import PAD_ID, TEXT_CONFIG, finish_model
from tests.helpers.tiny_glm4v import (
    GLM_IMAGE_END_ID,
    GLM_IMAGE_ID,
    GLM_IMAGE_START_ID,
    GLM_VIDEO_END_ID,
    GLM_VIDEO_ID,
    GLM_VIDEO_START_ID,
)

# head_dim 16, half of it rotary: 4 frequencies, split 1 (temporal) + 1 (height) + 2 (width).
_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [1, 1, 2],
    "partial_rotary_factor": 0.5,
}
_VISION = {
    "model_type": "glm4v_vision",
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "image_size": 56,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": TEXT_CONFIG["hidden_size"],
}
# Layer 0 dense, layers 1-3 of 4 routed experts (top 2) and one shared expert.
_MOE = {
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}


def _build(text: dict, dtype: torch.dtype, attn: str, seed: int, **load) -> Glm46VForConditionalGeneration:
    base = {key: value for key, value in TEXT_CONFIG.items() if key not in ("bos_token_id", "eos_token_id")}
    config = Glm46VConfig(
        text_config={**base, "rope_parameters": _ROPE, **text},
        vision_config=_VISION,
        image_token_id=GLM_IMAGE_ID,
        video_token_id=GLM_VIDEO_ID,
        image_start_token_id=GLM_IMAGE_START_ID,
        image_end_token_id=GLM_IMAGE_END_ID,
        video_start_token_id=GLM_VIDEO_START_ID,
        video_end_token_id=GLM_VIDEO_END_ID,
        pad_token_id=PAD_ID,
    )
    config.text_config.eos_token_id = TEXT_CONFIG["eos_token_id"]
    torch.manual_seed(seed)
    model = Glm46VForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype, **load)
    return finish_model(model, attn)


def tiny_glm46v(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> Glm46VForConditionalGeneration:
    """A 4-layer dense GLM-4 text model (``glm4v_text``) + 2-block GLM-4V vision tower."""
    return _build({"model_type": "glm4v_text"}, dtype, attn, seed)


def tiny_glm46v_moe(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> Glm46VForConditionalGeneration:
    """``tiny_glm46v`` with the MoE text model (``glm4v_moe_text``): rotate-half partial RoPE instead of
    the dense model's neighbouring pairs; the experts run eagerly (grouped_mm refuses float64)."""
    return _build({"model_type": "glm4v_moe_text", **_MOE}, dtype, attn, seed, experts_implementation="eager")
