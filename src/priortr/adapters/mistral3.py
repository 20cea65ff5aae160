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

from priortr.adapters.base import FamilyAdapter, VisualItem, prompt_layout, visual_runs


class Mistral3Adapter(FamilyAdapter):
    name = "mistral3"
    model_types = ("mistral3",)
    separator_token = "[IMG_END]"

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

    def visual_grid(self, config, inputs: dict, row: int) -> tuple[int, int]:
        """(rows, cols) of row ``row``'s image, ``image_sizes[row]`` over the pixels of one visual token
        (one image per prompt, so the row's image); tokens come in raster order."""
        sizes = inputs.get("image_sizes")
        if sizes is None:
            raise ValueError("the inputs hold no image_sizes, so the image's token grid is unknown")
        pixels = config.vision_config.patch_size * config.spatial_merge_size
        height, width = (int(v) for v in sizes[row])
        return height // pixels, width // pixels

    def image_view(self, image, processor):
        """The whole image: the Pixtral processor resizes it (keeping the aspect ratio, to a multiple of the
        patch size) and crops nothing."""
        return image

    def dummy_inputs(self, config, batch: int, text_tokens: int, generator: torch.Generator) -> dict:
        """A square image of up to 24 x 24 visual tokens (576, LLaVA-1.5's budget scale: 672 px for
        Mistral Small 3.1's 14 px patches), as large as the tower's ``image_size`` allows, with its row
        breaks and end marker (stand-in ids just below ``[IMG]``)."""
        vision = config.vision_config
        pixels = vision.patch_size * config.spatial_merge_size
        side = min(24, vision.image_size // pixels)
        image_id = config.image_token_id
        ids = prompt_layout(image_id, side * side, text_tokens, image_id - 2, batch, generator)
        rows = [token for _ in range(side) for token in [*[image_id] * side, image_id - 1]]
        image = torch.tensor([*rows[:-1], image_id - 2])
        ids = torch.cat([ids[:, :4], image.expand(batch, -1), ids[:, 4 + side * side :]], dim=1)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(batch, 3, side * pixels, side * pixels, generator=generator),
            "image_sizes": torch.tensor([[side * pixels] * 2] * batch),
        }
