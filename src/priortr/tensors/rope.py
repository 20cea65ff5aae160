"""Rotary position embedding (RoPE, Su et al., 2021) applied with the (cos, sin) pair a decoder hands its
layers: the adapters rotate queries and keys with it as their layers do, and the engine recomputes
attention rows with it."""

from __future__ import annotations

from collections.abc import Callable

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The standard RoPE rotation (Su et al., 2021) of the last dimension's two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotate: Callable[[torch.Tensor], torch.Tensor] = rotate_half,
) -> torch.Tensor:
    """Rotary position embedding with the (cos, sin) pair the decoder hands every layer.

    Args:
        x: [B, H, S, d] queries or keys.
        cos, sin: [B or 1, S, r] as produced by the model's rotary module (M-RoPE sections are already
            merged into them for Qwen-VL), r <= d: partial RoPE (Qwen3.5, GLM-4.1V) rotates the first r
            dimensions of each head and passes the others through, as transformers does.
        rotate: the pairing of rotated dimensions: halves (``rotate_half``, LLaMA) or neighbours
            (``rotate_pairs``, GLM).
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, r]
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate(x) * sin
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    return torch.cat([x_rot * cos + rotate(x_rot) * sin, x_pass], dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation of neighbouring dimensions (0, 1), (2, 3), ... (GPT-J / GLM convention)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
