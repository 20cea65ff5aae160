"""Tiny Qwen3.5 (dense and MoE) models: a hybrid decoder of Gated DeltaNet linear-attention layers and
full-attention layers, with Qwen3-VL's prompt layout and M-RoPE position ids (the batches of
``tests.helpers.tiny_qwen3_vl`` fit them: same special ids, same ``<|vision_start|> <|image_pad|> x N
<|vision_end|>`` runs).

``LAYER_TYPES``: layers 1 and 3 are full attention (as every fourth layer of the released models), 0 and 2
linear attention, so layer 1 is the one a scoring method may score; layers 2 and 3 run on the kept tokens.
Full attention applies the gated q projection (queries and a gate side by side, per head), q/k norms and
partial RoPE (a quarter of each head, as released); linear-attention layers keep a convolution state (the
last ``linear_conv_kernel_dim - 1`` inputs) and a recurrent state per sequence instead of keys and values.
"""

from __future__ import annotations

import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
)

from tests.helpers.tiny import PAD_ID, TEXT_CONFIG, finish_model, qwen_special_ids

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
FULL_ATTENTION_LAYERS = [1, 3]

# head_dim 16, a quarter rotary: 2 frequencies, interleaved T H (the width section is empty at this size).
_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [1, 1, 0],
    "mrope_interleaved": True,
    "partial_rotary_factor": 0.25,
}
_LINEAR = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": TEXT_CONFIG["hidden_size"],
    "num_position_embeddings": 64,
}
_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}


def _text_config(**extra) -> dict:
    return {
        **TEXT_CONFIG,
        "head_dim": 16,
        "layer_types": LAYER_TYPES,
        "rope_parameters": _ROPE,
        **_LINEAR,
        **extra,
    }


def tiny_qwen3_5(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> Qwen3_5ForConditionalGeneration:
    """A 4-layer Qwen3.5 (linear, full, linear, full) with a 2-block vision tower (patch 16, 2x2 merge)."""
    config = Qwen3_5Config(
        text_config=_text_config(), vision_config=_VISION, pad_token_id=PAD_ID, **qwen_special_ids()
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration._from_config(config, attn_implementation=attn, dtype=dtype)
    return finish_model(model, attn)


def moe_config() -> Qwen3_5MoeConfig:
    """``tiny_qwen3_5_moe``'s config."""
    return Qwen3_5MoeConfig(
        text_config=_text_config(**_MOE),
        vision_config=_VISION,
        pad_token_id=PAD_ID,
        architectures=["Qwen3_5MoeForConditionalGeneration"],
        **qwen_special_ids(),
    )


def tiny_qwen3_5_moe(
    dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0
) -> Qwen3_5MoeForConditionalGeneration:
    """``tiny_qwen3_5`` with 4-expert top-2 MoE MLPs and a shared expert in every layer; the experts run
    eagerly, since the default grouped_mm kernel refuses float64."""
    config = moe_config()
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration._from_config(
        config, attn_implementation=attn, dtype=dtype, experts_implementation="eager"
    )
    return finish_model(model, attn)
