"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``) and LLaVA-OneVision
(``LlavaOnevisionForConditionalGeneration``): AnyRes images, one ``<image>`` run per image.

An AnyRes image is a base crop (the whole image at the tower's resolution) plus a grid of high-resolution
tiles. ``LlavaNextModel.pack_image_features`` concatenates, per image, the base crop's patch features,
then the tiles' features stitched into one grid, unpadded to the image's aspect ratio, with the learned
``image_newline`` appended after every grid row; ``forward`` scatters that sequence, in that order, into
the image's ``<image>`` placeholders, which the processor writes as one contiguous run of exactly that
length (``LlavaNextProcessor._get_number_of_features``). The newline features are therefore ordinary
visual tokens of the run and are pruned like the others: the paper keeps 320 of LLaVA-NeXT's up to 2880
(5 x 576) visual tokens. The separator is the token right after the run (``\\n`` in the chat templates),
as for LLaVA-1.5.
"""

from __future__ import annotations

import math

from torch import nn
from transformers.image_processing_utils import select_best_resolution

from priortr.adapters.base import FamilyAdapter


class LlavaNextAdapter(FamilyAdapter):
    name = "llava-next"
    model_types = ("llava_next",)
    separator_token = "the token after the <image> run ('\\n' in the LLaVA-NeXT templates)"
    no_grid = (
        "an AnyRes image is two grids in one run, the base crop's and the stitched, unpadded tile grid with "
        "a newline token after each of its rows"
    )

    def vision_probe(self, model: nn.Module) -> None:
        """None: the tower runs once per crop (base + tiles), each crop with its own [CLS] token, and the
        tiles' patches are stitched, unpadded (some dropped) and interleaved with newline features that
        no crop attends to, so no [CLS] attention row lines up with the image's token run."""
        return None

    def max_tiles(self, config) -> int | None:
        """The tile-area cap of the stitched grid (OneVision's ``anyres_max_N``); NeXT has none."""
        return None

    def anyres_tokens(self, config, height: int, width: int) -> int:
        """Visual tokens of one ``height`` x ``width`` image: base crop + unpadded tile grid + one newline
        per grid row, as the processor counts them and ``pack_image_features`` produces them."""
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        best_height, best_width = select_best_resolution((height, width), config.image_grid_pinpoints)
        rows = side * (best_height // vision.image_size)
        cols = side * (best_width // vision.image_size)
        if width / height > cols / rows:  # unpad_image: the image's width fills the grid
            rows -= 2 * ((rows - int(round(height * (cols / width), 7))) // 2)
        else:
            cols -= 2 * ((cols - int(round(width * (rows / height), 7))) // 2)
        cap = self.max_tiles(config)
        ratio = math.sqrt(rows * cols / (cap * side**2)) if cap else 0.0
        if ratio > 1.1:  # OneVision downsamples grids above the cap (bilinear)
            rows, cols = int(rows // ratio), int(cols // ratio)
        return side * side + rows * cols + rows

    def anyres_crops(self, config, height: int, width: int) -> int:
        """Crops the tower encodes for one image: the base crop plus the best pinpoint's tiles."""
        size = config.vision_config.image_size
        best_height, best_width = select_best_resolution((height, width), config.image_grid_pinpoints)
        return 1 + (best_height // size) * (best_width // size)


class LlavaOnevisionAdapter(LlavaNextAdapter):
    """LLaVA-OneVision: LLaVA-NeXT's AnyRes layout on a SigLIP tower and a Qwen2 language model, plus
    videos and multi-image prompts.

    A single image is laid out as in LLaVA-NeXT, its tile grid downsampled when it exceeds
    ``anyres_max_N`` tiles of area. In a multi-image prompt (``batch_num_images`` > 1 for the row) each
    image is its base crop plus one newline token. A video is one ``<video>`` run of
    ``frames x ceil(side/2)^2`` pooled patch features plus one newline token. Each run is one item.

    The llava-hf chat template writes a message's images first, then its videos, then ``'\n' + text``:
    several images of one message form a single run (one item), and an image run directly followed by
    a video gets the first ``<video>`` token as its separator.
    """

    name = "llava-onevision"
    model_types = ("llava_onevision",)
    separator_token = "the token after the <image> or <video> run ('\\n' in the OneVision template)"

    def visual_token_ids(self, config) -> dict[str, int]:
        return {"image": config.image_token_id, "video": config.video_token_id}

    def vision_probe(self, model: nn.Module) -> None:
        """None: SigLIP has no [CLS] token (and the AnyRes layout would not line up with one anyway)."""
        return None

    def max_tiles(self, config) -> int | None:
        return int(config.vision_aspect_ratio.removeprefix("anyres_max_"))
