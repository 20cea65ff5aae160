"""MiniCPM-V 4.6 (``MiniCPMV4_6ForConditionalGeneration``): a NaViT SigLIP tower whose merges pool each
view's patches, and Qwen3.5's hybrid decoder (``Qwen3_5TextModel``: Gated DeltaNet linear-attention
layers and gated full-attention layers).

* An image is its global view and, when the processor slices it, ``rows x cols`` slices (at most 9),
  one line per row of slices (``MiniCPMV4_6Processor.replace_image_token``)::

      <image> <unk> x n0 </image> <slice> <unk> x n1 </slice> <slice> ... </slice> \\n <slice> ... </slice>

  ``<unk>`` being ``config.image_token_id`` (the processor may put ``<image_id>i</image_id>`` before
  ``<image>``). So one image is several runs of the placeholder, and ``visual_items`` groups them into one
  item (one budget): a run opens a new image when the token before it is ``<image>``, a slice run follows
  ``<slice>``. The separator is the token after the image's last run: the ``</slice>`` closing its last
  slice, or its ``</image>`` when it is not sliced. The config names none of these markers' ids, so
  ``<image>`` is read off the layout: the token before each row's first run. ``n`` is ``h * w / 16`` for a
  view of ``h x w`` patches, or ``h * w / 4`` with ``downsample_mode="4x"``, a call-time argument: the
  count is only ever read from the placeholders.
* A video is written frame by frame, each frame as an image (``<image>`` + the video placeholder, its
  slices), with nothing between frames: every frame is a video item of its own.
* The decoder's facts are Qwen3.5's (``Qwen3_5Adapter``): only full-attention layers can be scored, and a
  full-attention ``q_proj`` yields the query and an output gate per head. Positions are plain: ``generate()``
  passes ``[B, S]`` ids, which the text model repeats into its four M-RoPE rows, so the base class's
  position handling applies. MiniCPM-V 4.7 (``MiniCPMV4_7Adapter``, below) differs in its positions only.
"""

import torch
from torch import nn

from priortr.adapters.base import FamilyAdapter, VisionProbe, VisualItem, visual_runs
from priortr.adapters.qwen2_vl import QwenVLAdapter
from priortr.adapters.qwen3_5 import Qwen3_5Adapter


class MiniCPMVAdapter(FamilyAdapter):
    name = "minicpm-v-4.6"
    model_types = ("minicpmv4_6",)
    separator_token = "the </slice> closing the image's last slice (its </image> when it is not sliced)"

    attention_layers = Qwen3_5Adapter.attention_layers
    queries_and_keys = Qwen3_5Adapter.queries_and_keys

    def visual_token_ids(self, config) -> dict[str, int]:
        """The image and video placeholders (a config may name no video id)."""
        ids = {"image": config.image_token_id, "video": config.video_token_id}
        return {modality: token_id for modality, token_id in ids.items() if token_id is not None}

    def visual_items(self, config, input_ids: torch.Tensor) -> list[VisualItem]:
        """One item per image (video frame): its global run and its slice runs, the separator after the
        last. A run opens an item when the token before it is the opener (``<image>``)."""
        items = []
        for modality, token_id in self.visual_token_ids(config).items():
            runs = visual_runs(input_ids, token_id)
            opener = self._opener(input_ids, runs, modality)
            for row, row_runs in enumerate(runs):
                group: list[torch.Tensor] = []
                for k, (start, end) in enumerate(row_runs):
                    group.append(torch.arange(start, end, device=input_ids.device))
                    last = k + 1 == len(row_runs)
                    if last or int(input_ids[row, row_runs[k + 1][0] - 1]) == opener:
                        items.append(VisualItem(row, torch.cat(group), end, modality))
                        group = []
        return sorted(items, key=lambda item: (item.row, int(item.positions[0])))

    @staticmethod
    def _opener(input_ids: torch.Tensor, runs: list[list[tuple[int, int]]], modality: str) -> int | None:
        """The ``<image>`` id: the token before each row's first run of the placeholder."""
        if any(rr and rr[0][0] == 0 for rr in runs):
            raise ValueError(
                f"a prompt starts with a {modality} placeholder, with no <image> marker before it; the "
                "prompt does not follow the MiniCPM-V layout (<image> before each image's global view)"
            )
        openers = {int(input_ids[row, rr[0][0] - 1]) for row, rr in enumerate(runs) if rr}
        if len(openers) > 1:
            raise ValueError(
                f"the {modality}s of this batch are opened by different tokens {sorted(openers)}; the prompt "
                "does not follow the MiniCPM-V layout (<image> before each image's global view)"
            )
        return openers.pop() if openers else None

    def vision_probe(self, model: nn.Module) -> VisionProbe | None:
        """None: the SigLIP tower has no [CLS] token, and its merges make each visual token 4 or 16
        patches."""
        return None

    def vision_modules(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        multimodal = self.multimodal_model(model)
        return multimodal.vision_tower, multimodal.merger


class MiniCPMV4_7Adapter(MiniCPMVAdapter):
    """MiniCPM-V 4.7 (``MiniCPMV4_7ForConditionalGeneration``): 4.6's prompt layout and decoder, with canvas
    M-RoPE positions (``get_rope_index``: temporal, height and width ids placing each view on the image's
    canvas, from ``mm_token_type_ids`` and the markers' ids the config names). Their contract is Qwen2-VL's:
    ``generate()`` passes ``[4, B, S]`` ids (the text row first) and keeps ``rope_deltas`` on the
    multimodal model for later calls, so the position handling is ``QwenVLAdapter``'s."""

    name = "minicpm-v-4.7"
    model_types = ("minicpmv4_7",)

    text_positions = QwenVLAdapter.text_positions
    continuation_position_ids = QwenVLAdapter.continuation_position_ids
