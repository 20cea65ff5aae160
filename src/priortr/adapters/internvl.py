"""InternVL 2.5 / 3 / 3.5 as transformers writes them natively (``InternVLForConditionalGeneration``).

* An image is ``<img> <IMG_CONTEXT> x (image_seq_length * tiles) </img>``
  (``InternVLProcessor.replace_image_token``): the dynamic-resolution crops and the thumbnail of one image
  share one run, so the default ``visual_items`` gives one item (one budget) per image whose separator is
  ``</img>``, the end-of-image boundary token. Each tile is ``image_seq_length`` tokens (256 at 448 px:
  32x32 InternViT patches, CLS dropped, 2x2 pixel shuffle), tiles in crop order, the thumbnail last.
* A video is written frame by frame, ``Frame{i}: <img> <IMG_CONTEXT> x image_seq_length </img>`` joined by
  newlines (``replace_video_token``), and its frames join ``pixel_values``: every frame is an image item
  of its own; nothing in ``input_ids`` tells frames from images.
* The language model (Qwen2 or Llama; Qwen3 with q/k norms for InternVL3.5) is ``model.model.language_model``.
  ``generate()`` passes plain ``[B, S]`` position ids (``cumsum(attention_mask) - 1``) at prefill, at
  decode and when a later turn continues a cache, so the base class's position handling applies.
"""

import torch
from torch import nn

from priortr.adapters.base import FamilyAdapter, VisionProbe


class InternVLAdapter(FamilyAdapter):
    name = "internvl"
    model_types = ("internvl",)
    separator_token = "</img>"
    no_grid = "an image is several tiles and a thumbnail in one run, each tile a grid of its own"

    def queries_and_keys(
        self, attention: nn.Module, query_out: torch.Tensor, key_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head queries and keys; a Qwen3 text model (InternVL3.5) applies ``q_norm`` / ``k_norm``
        (RMSNorm over each head) to them before RoPE, as ``Qwen3Attention.forward`` does."""
        queries, keys = super().queries_and_keys(attention, query_out, key_out)
        q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        if q_norm is not None and k_norm is not None:
            queries, keys = q_norm(queries), k_norm(keys)
        return queries, keys

    def vision_probe(self, model: nn.Module) -> VisionProbe | None:
        """None: InternViT keeps a CLS token, but the 2x2 pixel shuffle makes each visual token four
        patches of one tile, and every tile (crops and thumbnail) has a CLS of its own, so no single [CLS]
        attention row ranks one image's visual tokens."""
        return None
