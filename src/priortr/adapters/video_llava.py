"""Video-LLaVA (``VideoLlavaForConditionalGeneration``): LLaVA-1.5 images and 8-frame videos, each one run
of its placeholder id; the separator is the token right after the run (``\\n`` in its template).

Images go through ``image_tower`` and lose the [CLS] token (``vision_feature_select_strategy='default'``):
256 ``<image>`` tokens on a 16 x 16 grid at 224 px. Videos go through a second tower, ``video_tower``,
frame by frame, and keep every frame's [CLS] token: 8 x 257 = 2056 ``<video>`` tokens, frame after frame.
"""

from __future__ import annotations

from torch import nn

from priortr.adapters.base import VisionProbe
from priortr.adapters.llava import LlavaAdapter


class VideoLlavaAdapter(LlavaAdapter):
    """LLaVA-1.5's image handling (``vision_probe``; in the tools, its token grid and benchmark prompt:
    one image per row, since a benchmark counts ``<image>`` tokens) on Video-LLaVA's ``image_tower``."""

    name = "video-llava"
    model_types = ("video_llava",)
    separator_token = "the token after the <image> or <video> run ('\\n' in the Video-LLaVA template)"

    def visual_token_ids(self, config) -> dict[str, int]:
        return {"image": config.image_token_id, "video": config.video_token_id}

    def vision_modules(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """The image path: ``image_tower`` and the projector (videos run ``video_tower`` instead)."""
        multimodal = self.multimodal_model(model)
        return multimodal.image_tower, multimodal.multi_modal_projector

    def vision_probe(self, model: nn.Module) -> VisionProbe | None:
        """LLaVA's probe on ``image_tower``: its [CLS] attention maps 1:1 onto an image's 256 tokens.

        Images only: a video's tokens come from ``video_tower``, whose hooks this probe does not hold,
        and include each frame's [CLS] token, so no [CLS] row lines up with a ``<video>`` run.
        """
        return super().vision_probe(model)
