"""Idefics3 and SmolVLM / SmolVLM2: ``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``.

Both processors write an image split into ``rows x cols`` sub-images as (``Idefics3Processor.
replace_image_token``, SmolVLM's ``_prompt_split_image``)::

    <fake><row_1_col_1> <image> x N  <fake><row_1_col_2> <image> x N  \\n   (one line per row of sub-images)
    ...
    \\n <fake><global-img> <image> x N <fake>                              (the whole image, downscaled)

and an image too small to split as its global part alone (``_prompt_single_image``); ``<fake>`` is
``<fake_token_around_image>`` and ``N = (image_size / patch_size)**2 / scale_factor**2`` (64, 81 or 169).
So one image is several runs of ``<image>`` ids, and only its global run is closed by a ``<fake>``
(a sub-image run is followed by the next sub-image's ``<fake>`` opener or by a newline). A SmolVLM2 video
is one unsplit image per frame, each its own item. ``visual_items`` groups the runs of each image into one
item (one budget) whose separator is that closing ``<fake>``.

The language model is ``model.model.text_model`` (Llama); ``generate()`` passes plain ``[B, S]`` position
ids (``cumsum(attention_mask) - 1``) at prefill, at decode and when a later turn continues a cache.
"""

import torch
from torch import nn

from priortr.adapters.base import FamilyAdapter, VisionProbe, VisualItem, visual_runs


class Idefics3Adapter(FamilyAdapter):
    name = "idefics3"
    model_types = ("idefics3", "smolvlm")
    separator_token = "the <fake_token_around_image> that closes the image's <global-img> run"

    def language_model(self, model: nn.Module) -> nn.Module:
        return self.multimodal_model(model).text_model

    def vision_modules(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        multimodal = self.multimodal_model(model)
        return multimodal.vision_model, multimodal.connector  # SigLIP tower, pixel shuffle + projection

    def visual_items(self, config, input_ids: torch.Tensor) -> list[VisualItem]:
        """One item per image: the positions of all its ``<image>`` runs, the separator right after its last.

        The config names no marker id but ``image_token_id``, so the layout gives the ``<fake>`` id: it is
        the token right after a row's last run (a global run's closer). A run ends its image when the gap
        to the row's next run holds that id twice (this image's closer and the next image's opener); within
        an image the gap is ``<fake><row_i_col_j>`` or ``\\n ... <fake><tag>``, one ``<fake>``, whatever
        the tokenizer makes of the tags and newlines.
        """
        runs = visual_runs(input_ids, config.image_token_id)
        closer = self._closing_marker(input_ids, runs)
        items = []
        for row, row_runs in enumerate(runs):
            group = []
            for k, (start, end) in enumerate(row_runs):
                group.append(torch.arange(start, end, device=input_ids.device))
                last = k + 1 == len(row_runs)
                if last or int((input_ids[row, end : row_runs[k + 1][0]] == closer).sum()) >= 2:
                    items.append(VisualItem(row, torch.cat(group), end))
                    group = []
        return items

    @staticmethod
    def _closing_marker(input_ids: torch.Tensor, runs: list[list[tuple[int, int]]]) -> int | None:
        """The ``<fake_token_around_image>`` id: the token after each row's last run, where one follows."""
        seq = input_ids.shape[1]
        closers = {int(input_ids[row, rr[-1][1]]) for row, rr in enumerate(runs) if rr and rr[-1][1] < seq}
        if len(closers) > 1:
            raise ValueError(
                f"the images of this batch are closed by different tokens {sorted(closers)}; the prompt "
                "does not follow the Idefics3/SmolVLM layout (<fake_token_around_image> after each image)"
            )
        if not closers and any(len(rr) > 1 for rr in runs):
            raise ValueError(
                "the prompt ends inside an image (no <fake_token_around_image> after its last <image> run), "
                "so its sub-image runs cannot be grouped into images"
            )
        return closers.pop() if closers else None

    def vision_probe(self, model: nn.Module) -> VisionProbe | None:
        """None: the SigLIP tower has no [CLS] token, and the connector's pixel shuffle makes each visual
        token ``scale_factor**2`` patches."""
        return None

    def dummy_inputs(self, config, batch: int, text_tokens: int, generator: torch.Generator) -> dict:
        """A 640x427 photo as the processors split it: resized to the longest edge of 4 sub-images, a 3x4
        grid plus the global image, 13 sub-images (1053 tokens for SmolVLM2-2.2B, 832 for SmolVLM-256M).

        The ``text_tokens`` text tokens come on top of the image's 32 markers, whose ids are stand-ins just
        below ``<image>``: ``<fake>`` right under it, then newline and the tags."""
        if text_tokens < 6:
            raise ValueError(f"a benchmark prompt needs at least 6 text tokens; got {text_tokens}")
        rows, cols = 3, 4
        vision = config.vision_config
        n_sub = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
        image_id = config.image_token_id
        fake, global_tag, newline = image_id - 1, image_id - 2, image_id - 3
        image: list[int] = []
        for i in range(rows):
            for j in range(cols):
                image += [fake, global_tag - 1 - (cols * i + j), *[image_id] * n_sub]
            image.append(newline)
        image += [newline, fake, global_tag, *[image_id] * n_sub, fake]
        text = torch.randint(100, global_tag - 1 - rows * cols, (batch, text_tokens), generator=generator)
        ids = torch.cat([text[:, :4], torch.tensor(image).expand(batch, -1), text[:, 4:]], dim=1)
        size = vision.image_size
        n_images = rows * cols + 1
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(batch, n_images, 3, size, size, generator=generator),
            "pixel_attention_mask": torch.ones(batch, n_images, size, size, dtype=torch.bool),
        }
