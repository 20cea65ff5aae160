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
    no_grid = "an image is several sub-images and a global view, each a grid of its own"

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
