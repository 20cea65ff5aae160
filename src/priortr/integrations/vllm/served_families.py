"""The served families, one block each: how the family lays out an image (``FamilyLayout``), its model
class (vLLM's own with the plug-in's hooks, ``models.py``), its multimodal processor (vLLM's own with
the plug-in's, ``processor.py``) and its registry row (``Family``), which ``registration.register_all``
registers alike. A new family is one block here, its adapter in ``priortr.adapters``, and in the tests
its row in the family table (``tests/vllm/family_contract.py``) with its tiny checkpoint
(``tests/vllm/checkpoints.py``), its fixture and a test class naming the row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.model_executor.models import (
    glm4_1v,
    interns1,
    llava,
    llava_next,
    llava_onevision,
    mistral3,
    qwen2_5_vl,
    qwen2_vl,
    qwen3_vl,
)
from vllm.model_executor.models.glm4_1v import Glm4vForConditionalGeneration
from vllm.model_executor.models.interns1 import InternS1ForConditionalGeneration
from vllm.model_executor.models.llava import LlavaForConditionalGeneration
from vllm.model_executor.models.llava_next import LlavaNextForConditionalGeneration
from vllm.model_executor.models.llava_onevision import LlavaOnevisionForConditionalGeneration
from vllm.model_executor.models.mistral3 import Mistral3ForConditionalGeneration
from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration
from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration
from vllm.model_executor.models.qwen3_vl_moe import (
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLMoeProcessingInfo,
)
from vllm.model_executor.models.vision import get_num_selected_vision_tokens, get_vision_encoder_info

from priortr.integrations.vllm.config_hooks import (
    DeepStackConfigHook,
    MoeDeepStackConfigHook,
    PruningConfigHook,
)
from priortr.integrations.vllm.models import (
    AnyResImages,
    LinearPositions,
    PruningModel,
    QwenPositions,
    SizedImages,
)
from priortr.integrations.vllm.positions import FamilyLayout, ImageSlots
from priortr.integrations.vllm.processor import PruningProcessor


@dataclass(frozen=True)
class Family:
    """One served architecture: vLLM's name for it, the plug-in's model class, the config hook run on
    its model config, and the multimodal processor registered for the class (a factory or a processor
    class, with vLLM's processing info and dummy inputs builder of the family). Its layout is its model
    class's; a processor class must declare the same one."""

    architecture: str
    model: type
    hook: type
    processor: Callable[..., object]
    info: Callable[..., object]
    dummy_inputs: type

    def __post_init__(self) -> None:
        declared = getattr(self.processor, "layout", self.model.layout)
        if declared != self.model.layout:
            raise TypeError(
                f"priortr: {self.architecture}'s processor lays images out as {declared}, its model class "
                f"as {self.model.layout}; one block, one layout"
            )

    @property
    def layout(self) -> FamilyLayout:
        """How the family lays out an image's tokens and positions."""
        return self.model.layout


# LLaVA-1.5 (CLIP / SigLIP towers, Llama / Mistral / Qwen2 language models)

LLAVA_LAYOUT = FamilyLayout(linear_rope=True, adjacent_images=True)
"""1-D RoPE, an image one run of visual tokens; back-to-back images one run under one budget."""


class PruningLlava(LinearPositions, PruningModel, LlavaForConditionalGeneration):
    """vLLM's LLaVA-1.5 with priortr (1-D RoPE)."""

    stock = LlavaForConditionalGeneration
    layout = LLAVA_LAYOUT

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        info = get_vision_encoder_info(config)
        size = info.get_image_size()
        self._tokens_per_image = get_num_selected_vision_tokens(
            info.get_num_image_tokens(image_width=size, image_height=size),
            config.vision_feature_select_strategy,
        )

    def _slots(self, feature: Any) -> ImageSlots:
        span = feature.mm_position
        return ImageSlots(span.offset, span.length, self._tokens_per_image, (1, self._tokens_per_image))


class LlavaProcessor(PruningProcessor, llava.LlavaMultiModalProcessor):
    """LLaVA-1.5's processor, pruned requests cut to K placeholders per image (adjacent images: one
    run, one budget, as ``priortr.apply`` prunes them)."""

    layout = LLAVA_LAYOUT


def llava_processor(info: object, dummy_inputs: object) -> object:
    """vLLM's LLaVA processor choice, with the pruning processor for LLaVA-1.5 (CLIP / SigLIP towers)."""
    if isinstance(info, llava.LlavaProcessingInfo):
        return LlavaProcessor(info, dummy_inputs)
    return llava._build_llava_or_pixtral_hf_processor(info, dummy_inputs)


LLAVA = Family(
    "LlavaForConditionalGeneration",
    PruningLlava,
    PruningConfigHook,
    llava_processor,
    llava._build_llava_or_pixtral_hf_info,
    llava.LlavaDummyInputsBuilder,
)


# LLaVA-NeXT (AnyRes tiles)

LLAVA_NEXT_LAYOUT = FamilyLayout(linear_rope=True, adjacent_images=True)
"""As LLaVA-1.5's: an image's base crop and AnyRes grid are one run of visual tokens."""


class PruningLlavaNext(LinearPositions, AnyResImages, PruningModel, LlavaNextForConditionalGeneration):
    """vLLM's LLaVA-NeXT with priortr (1-D RoPE, as LLaVA; AnyRes as ``AnyResImages``)."""

    stock = LlavaNextForConditionalGeneration
    layout = LLAVA_NEXT_LAYOUT


class LlavaNextProcessor(PruningProcessor, llava_next.LlavaNextMultiModalProcessor):
    """LLaVA-NeXT's processor, pruned requests cut to K placeholders per image (adjacent images: one
    run, one budget, as ``priortr.apply`` prunes them)."""

    layout = LLAVA_NEXT_LAYOUT


LLAVA_NEXT = Family(
    "LlavaNextForConditionalGeneration",
    PruningLlavaNext,
    PruningConfigHook,
    LlavaNextProcessor,
    llava_next.LlavaNextProcessingInfo,
    llava.LlavaDummyInputsBuilder,
)


# LLaVA-OneVision (AnyRes tiles, downsampled above anyres_max_N)

LLAVA_ONEVISION_LAYOUT = FamilyLayout(linear_rope=True, adjacent_images=True)
"""As LLaVA-NeXT's; its llava-hf chat template writes a message's images back to back."""


class PruningLlavaOnevision(
    LinearPositions, AnyResImages, PruningModel, LlavaOnevisionForConditionalGeneration
):
    """vLLM's LLaVA-OneVision with priortr (1-D RoPE, as LLaVA; AnyRes as ``AnyResImages``, its tile
    grid downsampled above ``anyres_max_N``)."""

    stock = LlavaOnevisionForConditionalGeneration
    layout = LLAVA_ONEVISION_LAYOUT


class LlavaOnevisionProcessor(PruningProcessor, llava_onevision.LlavaOnevisionMultiModalProcessor):
    """LLaVA-OneVision's processor, pruned requests cut to K placeholders per image (adjacent images, as
    its llava-hf chat template writes a message's images: one run, one budget, as ``priortr.apply``
    prunes them)."""

    layout = LLAVA_ONEVISION_LAYOUT


LLAVA_ONEVISION = Family(
    "LlavaOnevisionForConditionalGeneration",
    PruningLlavaOnevision,
    PruningConfigHook,
    LlavaOnevisionProcessor,
    llava_onevision.LlavaOnevisionProcessingInfo,
    llava_onevision.LlavaOnevisionDummyInputsBuilder,
)


# InternVL 2.5 / 3 / 3.5 in the Hugging Face format

INTERNVL_LAYOUT = FamilyLayout(linear_rope=True)
"""1-D RoPE, an image's tiles one run of visual tokens between ``<img>`` and ``</img>``."""


class PruningInternVL(LinearPositions, SizedImages, PruningModel, InternS1ForConditionalGeneration):
    """vLLM's InternVL in the Hugging Face format (``InternVLForConditionalGeneration``, which vLLM
    serves with its InternS1 class) with priortr (1-D RoPE, as LLaVA).

    vLLM lays out an image as ``<img> <IMG_CONTEXT> x N </img>``, one placeholder range whose
    ``is_embed`` mask marks the ``<IMG_CONTEXT>`` run of N = ``num_image_token`` tokens per tile (256
    for the released 448-px tiles), the crops and the thumbnail of one image in one run, as
    ``priortr.apply`` prunes it: one budget over the image's tiles, ``</img>`` its separator
    (``priortr.adapters.internvl``)."""

    stock = InternS1ForConditionalGeneration
    layout = INTERNVL_LAYOUT

    def _image_tokens(self, data: Mapping[str, Any]) -> int:
        return int(data["image_num_patches"].data) * self.num_image_token


class InternVLProcessor(PruningProcessor, interns1.InternS1MultiModalProcessor):
    """InternVL's processor (Hugging Face format; vLLM's InternS1 processor), pruned requests cut to K
    ``<IMG_CONTEXT>`` placeholders per image between its ``<img>`` and ``</img>``."""

    layout = INTERNVL_LAYOUT


INTERNVL = Family(
    "InternVLForConditionalGeneration",
    PruningInternVL,
    PruningConfigHook,
    InternVLProcessor,
    interns1.InternS1ProcessingInfo,
    interns1.InternS1DummyInputsBuilder,
)


# Mistral 3 (Pixtral tower; Mistral Small 3.1 / 3.2)

MISTRAL3_LAYOUT = FamilyLayout(linear_rope=True, row_breaks=True)
"""1-D RoPE, an image's rows of visual tokens with a row break between them."""


class PruningMistral3(LinearPositions, SizedImages, PruningModel, Mistral3ForConditionalGeneration):
    """vLLM's Mistral 3 (Pixtral tower; Mistral Small 3.1 / 3.2) with priortr (1-D RoPE, as LLaVA).

    vLLM lays out an image of ``rows x cols`` tokens as ``PixtralProcessor`` writes it, ``[IMG] x cols``
    then ``[IMG_BREAK]`` per row, the last break replaced by ``[IMG_END]``: one placeholder range whose
    ``is_embed`` mask marks the ``[IMG]`` tokens. ``priortr.apply`` prunes the ``[IMG]`` tokens only, one
    budget per image, ``[IMG_END]`` its separator, the row breaks kept as text
    (``priortr.adapters.mistral3``); so does the plug-in (``MISTRAL3_LAYOUT``). The grid comes
    from the image's pixels, which vLLM's processor crops to the image's resized size, a whole number of
    tokens on each side (``Mistral3Adapter.pixel_grid``)."""

    stock = Mistral3ForConditionalGeneration
    layout = MISTRAL3_LAYOUT

    def _image_grid(self, data: Mapping[str, Any]) -> tuple[int, int]:
        height, width = data["pixel_values"].data.shape[-2:]
        return self._served.adapter.pixel_grid(self.config, int(height), int(width))


class Mistral3Processor(PruningProcessor, mistral3.Mistral3MultiModalProcessor):
    """Mistral 3's processor, pruned requests laid out with K ``[IMG]`` slots per image, its row breaks
    and ``[IMG_END]`` after them."""

    layout = MISTRAL3_LAYOUT


MISTRAL3 = Family(
    "Mistral3ForConditionalGeneration",
    PruningMistral3,
    PruningConfigHook,
    Mistral3Processor,
    mistral3.Mistral3ProcessingInfo,
    mistral3.Mistral3DummyInputsBuilder,
)


# Qwen2-VL, Qwen2.5-VL

QWEN_LAYOUT = FamilyLayout(linear_rope=False)
"""M-RoPE, an image one grid of visual tokens between ``<|vision_start|>`` and ``<|vision_end|>``."""


class PruningQwen2VL(QwenPositions, PruningModel, Qwen2VLForConditionalGeneration):
    """vLLM's Qwen2-VL with priortr (M-RoPE)."""

    stock = Qwen2VLForConditionalGeneration
    layout = QWEN_LAYOUT


class Qwen2VLProcessor(PruningProcessor, qwen2_vl.Qwen2VLMultiModalProcessor):
    """Qwen2-VL's processor, pruned requests cut to K placeholders per image."""

    layout = QWEN_LAYOUT


QWEN2_VL = Family(
    "Qwen2VLForConditionalGeneration",
    PruningQwen2VL,
    PruningConfigHook,
    Qwen2VLProcessor,
    qwen2_vl.Qwen2VLProcessingInfo,
    qwen2_vl.Qwen2VLDummyInputsBuilder,
)


class PruningQwen2_5_VL(QwenPositions, PruningModel, Qwen2_5_VLForConditionalGeneration):
    """vLLM's Qwen2.5-VL with priortr (M-RoPE)."""

    stock = Qwen2_5_VLForConditionalGeneration
    layout = QWEN_LAYOUT


class Qwen2_5_VLProcessor(PruningProcessor, qwen2_5_vl.Qwen2_5_VLMultiModalProcessor):
    """Qwen2.5-VL's processor, pruned requests cut to K placeholders per image."""

    layout = QWEN_LAYOUT


QWEN2_5_VL = Family(
    "Qwen2_5_VLForConditionalGeneration",
    PruningQwen2_5_VL,
    PruningConfigHook,
    Qwen2_5_VLProcessor,
    qwen2_5_vl.Qwen2_5_VLProcessingInfo,
    qwen2_5_vl.Qwen2_5_VLDummyInputsBuilder,
)


# Qwen3-VL, dense and MoE (DeepStack)


class PruningQwen3VL(QwenPositions, PruningModel, Qwen3VLForConditionalGeneration):
    """vLLM's Qwen3-VL with priortr (interleaved M-RoPE, q/k norms, DeepStack).

    vLLM's encoder returns each image's rows as [N, D * (1 + J)], its embeddings and J DeepStack
    features, and ``embed_input_ids`` leaves the features of the step's tokens in a buffer that the
    forward adds to the outputs of decoder layers 0..J-1; a pruned step takes them from that buffer."""

    stock = Qwen3VLForConditionalGeneration
    layout = QWEN_LAYOUT

    def _encoder_width(self) -> int:
        return super()._encoder_width() * (1 + self.deepstack_num_level)

    def _step_injections(self, rows: int) -> list[torch.Tensor]:
        found = self._get_deepstack_input_embeds(rows)  # views of the buffer, cleared below
        if found is None:
            return []
        injected = [
            found[f"deepstack_input_embeds_{level}"].clone() for level in range(self.deepstack_num_level)
        ]
        self._clear_deepstack_input_embeds(rows)
        return injected


class Qwen3VLProcessor(PruningProcessor, qwen3_vl.Qwen3VLMultiModalProcessor):
    """Qwen3-VL's processor (dense and MoE: vLLM serves both with it), pruned requests cut to K
    placeholders per image."""

    layout = QWEN_LAYOUT


QWEN3_VL = Family(
    "Qwen3VLForConditionalGeneration",
    PruningQwen3VL,
    DeepStackConfigHook,
    Qwen3VLProcessor,
    qwen3_vl.Qwen3VLProcessingInfo,
    qwen3_vl.Qwen3VLDummyInputsBuilder,
)


class PruningQwen3VLMoe(PruningQwen3VL, Qwen3VLMoeForConditionalGeneration):
    """vLLM's Qwen3-VL MoE (Qwen3-VL-30B-A3B, 235B-A22B) with priortr: Qwen3-VL's vision side,
    positions and DeepStack as ``PruningQwen3VL``, a language model whose decoder layers' MLPs are
    vLLM's sparse MoE blocks (``decoder.py``). Served under tensor parallelism (every rank makes the
    same MoE calls); data and expert parallelism are refused (``config_hooks.moe_refusals``)."""

    stock = Qwen3VLMoeForConditionalGeneration


QWEN3_VL_MOE = Family(
    "Qwen3VLMoeForConditionalGeneration",
    PruningQwen3VLMoe,
    MoeDeepStackConfigHook,
    Qwen3VLProcessor,
    Qwen3VLMoeProcessingInfo,
    qwen3_vl.Qwen3VLDummyInputsBuilder,
)


# GLM-4.1V

GLM4V_LAYOUT = FamilyLayout(linear_rope=False)
"""M-RoPE as Qwen2-VL's, an image one grid of visual tokens between ``<|begin_of_image|>`` and
``<|end_of_image|>``."""


class PruningGlm4v(QwenPositions, PruningModel, Glm4vForConditionalGeneration):
    """vLLM's GLM-4.1V with priortr (M-RoPE; a GLM-4 language model, its layers' sandwich norms and
    partial RoPE as ``decoder.py`` reads them).

    vLLM lays out an image as ``Glm4vProcessor`` writes it, ``<|begin_of_image|> <|image|> x N
    <|end_of_image|>``, its placeholder range the N ``<|image|>`` tokens, and places them as Qwen2-VL
    does (``get_mrope_input_positions`` from each image's offset and ``image_grid_thw``), so the
    positions are ``QwenPositions``'. ``priortr.apply`` prunes an image's N tokens under one budget,
    ``<|end_of_image|>`` its separator (``priortr.adapters.glm4v``)."""

    stock = Glm4vForConditionalGeneration
    layout = GLM4V_LAYOUT


class Glm4vProcessor(PruningProcessor, glm4_1v.Glm4vMultiModalProcessor):
    """GLM-4.1V's processor, pruned requests cut to K ``<|image|>`` placeholders per image between its
    ``<|begin_of_image|>`` and ``<|end_of_image|>``."""

    layout = GLM4V_LAYOUT


GLM4V = Family(
    "Glm4vForConditionalGeneration",
    PruningGlm4v,
    PruningConfigHook,
    Glm4vProcessor,
    glm4_1v.Glm4vProcessingInfo,
    glm4_1v.Glm4vDummyInputsBuilder,
)


FAMILIES = (
    LLAVA,
    QWEN2_VL,
    QWEN2_5_VL,
    QWEN3_VL,
    QWEN3_VL_MOE,
    INTERNVL,
    LLAVA_ONEVISION,
    LLAVA_NEXT,
    MISTRAL3,
    GLM4V,
)
"""Every served family, one block each above: ``registration.register_all`` registers them all alike."""
