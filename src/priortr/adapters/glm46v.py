"""GLM-4.6V (``Glm46VForConditionalGeneration``): GLM-4.1V's model (``Glm4vModel``: vision tower, prompt
layout, 3-D RoPE ids) under either of the two text models its config may name.

* Prompt layout and positions are GLM-4.1V's (``Glm4vAdapter``): an image is ``<|begin_of_image|> <|image|>
  x N <|end_of_image|>``, its separator ``<|end_of_image|>``; a video is written frame by frame with the
  *image* placeholder (``Glm46VProcessor.replace_frame_token_id``: ``<|begin_of_image|> <|image|> x n
  <|end_of_image|>`` and the frame's ``"{t:.1f} seconds"``), so every frame is an item closed by its own
  ``<|end_of_image|>``; ``generate()`` passes ``[4, B, S]`` ids (text row + temporal, height, width).
* ``Glm46VModel`` builds its language model from ``text_config.model_type``: ``glm4v_text`` (the config's
  default) rotates neighbouring dimension pairs (``rotate_half_llm``), ``glm4v_moe_text``
  (MoE) rotates the two halves (``rotate_half``), each over the first ``partial_rotary_factor``
  of a head; another text model is refused at ``apply``.
"""

from collections.abc import Callable

import torch
from torch import nn

from priortr.adapters.glm4v import Glm4vAdapter
from priortr.tensors.rope import apply_rope, rotate_half, rotate_pairs

ROTATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "glm4v_text": rotate_pairs,
    "glm4v_moe_text": rotate_half,
}
"""The RoPE pairing of each text model ``Glm46VModel`` can hold, by its config's ``model_type``."""


class Glm46VAdapter(Glm4vAdapter):
    name = "glm46v"
    model_types = ("glm46v",)

    def attention_layers(self, model: nn.Module) -> list[int]:
        """Every decoder layer, once the text model's RoPE is known (``apply`` asks for them first, so an
        unknown text model is refused there)."""
        rotation(model.config.get_text_config().model_type)
        return super().attention_layers(model)

    def rotate(self, attention: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """RoPE as the layer's text model applies it, over the first ``cos.shape[-1]`` dimensions of each
        head."""
        cos, sin = rope
        return apply_rope(x, cos, sin, rotate=rotation(attention.config.model_type))


def rotation(text_model: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The RoPE pairing of the text model whose config's ``model_type`` is ``text_model``; a ValueError
    naming the known ones for any other."""
    if text_model not in ROTATIONS:
        raise ValueError(
            f"this GLM-4.6V model's text model is {text_model!r}, whose RoPE priortr does not know; "
            f"supported text models: {', '.join(ROTATIONS)}"
        )
    return ROTATIONS[text_model]
