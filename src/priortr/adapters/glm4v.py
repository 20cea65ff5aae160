"""GLM-4.1V (``Glm4vForConditionalGeneration``): Qwen2-VL-style dynamic-resolution images and videos with
3-D RoPE, and a GLM-4 language model whose RoPE rotates neighbouring dimensions over part of each head.

* An image is ``<|begin_of_image|> <|image|> x N <|end_of_image|>`` (the processor expands the chat
  template's ``<|image|>``); its separator is ``<|end_of_image|>``. A video is ``<|begin_of_video|>``, then
  per frame (one temporal patch) ``<|begin_of_image|> <|image|> x n <|end_of_image|> <timestamp>``, then
  ``<|end_of_video|>`` (``Glm4vProcessor.replace_frame_token_id``): its frames use the *image* placeholder,
  so every frame is an item of its own whose separator is its ``<|end_of_image|>``, of modality ``video``
  when it sits inside the video markers (``mm_token_type_ids`` 2, as ``get_rope_index`` lays them out).
* Position ids are Qwen2-VL's: ``generate()`` passes ``[4, B, S]`` (the text row and the three temporal,
  height and width rows of ``get_rope_index``), and ``[3, B, S]`` rows shifted by ``rope_deltas`` when a
  later turn continues a cache (``Glm4vModel.compute_3d_position_ids``); the rotary module merges the
  three rows into one ``(cos, sin)`` per layer.
* The decoder's RoPE (``apply_rotary_pos_emb`` with ``rotate_half_llm``) pairs dimensions (0, 1), (2, 3),
  ... of the first ``partial_rotary_factor`` of each head and leaves the rest as they are.
"""

import torch
from torch import nn

from priortr.adapters.base import VisualItem, visual_runs
from priortr.adapters.qwen2_vl import QwenVLAdapter
from priortr.tensors.rope import apply_rope, rotate_pairs


class Glm4vAdapter(QwenVLAdapter):
    name = "glm4v"
    model_types = ("glm4v",)
    separator_token = "<|end_of_image|>"

    def visual_items(self, config, input_ids: torch.Tensor) -> list[VisualItem]:
        """Every run of ``<|image|>`` is an item (an image, or one frame of a video), its separator the
        ``<|end_of_image|>`` after it; frames between ``<|begin_of_video|>`` and ``<|end_of_video|>`` are
        ``video`` items."""
        in_video = (input_ids == config.video_start_token_id).long().cumsum(dim=1)
        in_video -= (input_ids == config.video_end_token_id).long().cumsum(dim=1)
        items = []
        for row, runs in enumerate(visual_runs(input_ids, config.image_token_id)):
            for start, end in runs:
                modality = "video" if int(in_video[row, start]) > 0 else "image"
                positions = torch.arange(start, end, device=input_ids.device)
                items.append(VisualItem(row, positions, end, modality))
        return items

    def rotate(self, attention: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """GLM's RoPE: neighbouring dimensions rotate together, over the first ``cos.shape[-1]`` of a head."""
        cos, sin = rope
        return apply_rope(x, cos, sin, rotate=rotate_pairs)
