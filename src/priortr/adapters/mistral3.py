"""Mistral 3 (``Mistral3ForConditionalGeneration``: Mistral Small 3.1 / 3.2, Ministral 3): a Pixtral vision
tower at native resolution and aspect ratio, a Mistral (or Ministral 3) language model.

``PixtralProcessor`` writes an image of ``rows x cols`` visual tokens (one per ``patch_size *
spatial_merge_size`` pixels) row by row, with a row break after each row and the last break replaced by the
end marker::

    [IMG] x cols [IMG_BREAK]  [IMG] x cols [IMG_BREAK]  ...  [IMG] x cols [IMG_END]

Only ``[IMG]`` (``config.image_token_id``) receives image features; ``[IMG_BREAK]`` and ``[IMG_END]`` are
ordinary token embeddings that tell the model the grid's shape. So one image is ``rows`` runs of ``[IMG]``:
its visual tokens are the ``[IMG]`` positions (row breaks are kept, never pruned, like any text token) and
its separator, the prior's slot, is ``[IMG_END]``, the first token after its last visual token. Position ids
are plain ``[B, S]`` text positions at prefill, decode and later turns (the base class's handling).
"""

import torch

from priortr.adapters.base import FamilyAdapter, VisualItem, visual_runs


class Mistral3Adapter(FamilyAdapter):
    name = "mistral3"
    model_types = ("mistral3",)
    separator_token = "[IMG_END]"
    no_grid = "its [IMG] rows form a grid (pixel_grid), which this adapter does not hand to the engine yet"

    def pixel_grid(self, config, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of the visual tokens of an image the processor resized to ``height`` x
        ``width`` pixels, a whole number of tokens of ``patch_size * spatial_merge_size`` pixels on each
        side. The one rule for the tools' score maps and the vLLM plug-in's positions."""
        pixels = config.vision_config.patch_size * config.spatial_merge_size
        return height // pixels, width // pixels

    def visual_items(self, config, input_ids: torch.Tensor) -> list[VisualItem]:
        """One item per image: its ``[IMG]`` runs, which a single row-break token separates.

        The config names only ``[IMG]``; the end marker's id is the token after each row's last run (the
        processor ends every image with it), and a run followed by that id ends its image.
        """
        runs = visual_runs(input_ids, config.image_token_id)
        closer = self._end_marker(input_ids, runs)
        items = []
        for row, row_runs in enumerate(runs):
            group = []
            for k, (start, end) in enumerate(row_runs):
                group.append(torch.arange(start, end, device=input_ids.device))
                if end == input_ids.shape[1] or int(input_ids[row, end]) == closer:
                    items.append(VisualItem(row, torch.cat(group), end))
                    group = []
                elif k + 1 == len(row_runs) or row_runs[k + 1][0] != end + 1:
                    raise ValueError(
                        "an image's [IMG] runs are not closed by [IMG_END] (a run is followed by neither a "
                        "row break and the next row nor the end marker); the prompt does not follow the "
                        "Pixtral layout (use the model's processor)"
                    )
        return items

    @staticmethod
    def _end_marker(input_ids: torch.Tensor, runs: list[list[tuple[int, int]]]) -> int | None:
        """The ``[IMG_END]`` id: the token after each row's last run, where one follows."""
        seq = input_ids.shape[1]
        markers = {int(input_ids[row, rr[-1][1]]) for row, rr in enumerate(runs) if rr and rr[-1][1] < seq}
        if len(markers) > 1:
            raise ValueError(
                f"the images of this batch end with different tokens {sorted(markers)}; the prompt does not "
                "follow the Pixtral layout ([IMG_END] after each image)"
            )
        return markers.pop() if markers else None
