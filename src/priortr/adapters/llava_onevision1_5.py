"""LLaVA-OneVision-1.5 (``LlavaOnevision15ForConditionalGeneration``): Qwen2-VL's prompt markers and
merged patch grids in front of a Qwen3 language model with plain 1-D RoPE.

* An image is ``<|vision_start|> <|image_pad|> x N <|vision_end|>``, N = h * w / 4 of its ``image_grid_thw``
  (the RICE tower merges 2 x 2 patches, row-major as its 2-D RoPE ids say); its separator is
  ``<|vision_end|>``. A video is one run ``<|vision_start|> <|video_pad|> x (t * h * w / 4)
  <|vision_end|>`` (``Exaone4_5_Processor`` expands the pad by the whole ``video_grid_thw``), one item.
* Positions are 1-D: ``generate()`` passes ``[B, S]`` text positions, and without them the model numbers
  the sequence ``0 .. S-1`` from the cache length (``LlavaOnevision15Model.forward``); there is no
  M-RoPE and no ``rope_deltas``. Qwen2-VL's ``[4, B, S]`` handling does not apply, and 3-row ids are
  refused rather than read as M-RoPE.
* Decoder attention is Qwen3's: ``q_norm`` / ``k_norm`` (RMSNorm over each head) before rotate-half RoPE;
  scores without them rank other tokens.
"""

import torch
from torch import nn

from priortr.adapters.qwen2_vl import QwenVLAdapter
from priortr.adapters.qwen3_vl import Qwen3VLAdapter


class LlavaOnevision15Adapter(QwenVLAdapter):
    name = "llava-onevision-1.5"
    model_types = ("llava_onevision1_5",)

    def text_positions(self, model: nn.Module, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """``position_ids`` themselves ([B, S] or [1, S] text positions); ids of another shape are refused."""
        if position_ids is not None and position_ids.ndim != 2:
            raise ValueError(
                "LLaVA-OneVision-1.5 numbers its tokens with 1-D RoPE: position ids must be [B, S]; got "
                f"shape {tuple(position_ids.shape)} (M-RoPE ids are Qwen2-VL's, not this model's)"
            )
        return position_ids

    def continuation_position_ids(self, model: nn.Module, text_positions: torch.Tensor) -> torch.Tensor:
        """The text positions [B, S] themselves."""
        return text_positions

    def queries_and_keys(
        self, attention: nn.Module, query_out: torch.Tensor, key_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head ``q_norm(q)`` [B, H, S, d] and ``k_norm(k)`` [B, H_kv, S, d], as ``Qwen3Attention``
        computes them before RoPE."""
        return Qwen3VLAdapter.queries_and_keys(self, attention, query_out, key_out)
