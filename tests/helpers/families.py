"""Every supported family as a tiny random-weight model, and the prompt layouts each is tested on.

``FAMILIES`` pairs a model builder with a batch of one image per row and the same visual-token count
in every row (the layout every method and equivalence test runs on); ``LAYOUTS`` adds, per family,
what else it can be given: rows with different token counts (``ragged``), videos, several images or
an image and a video per prompt.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import transformers
from packaging.version import Version
from transformers import PreTrainedModel, masking_utils

from tests.helpers.tiny import (
    Batch,
    llava_batch,
    qwen_batch,
    qwen_batch_12,
    qwen_video_batch,
    tiny_llava,
    tiny_qwen2_5_vl,
    tiny_qwen2_vl,
)
from tests.helpers.tiny_gemma3 import gemma3_batch, gemma3_multi_image_batch, gemma3_ragged_batch, tiny_gemma3
from tests.helpers.tiny_gemma4 import (
    gemma4_batch,
    gemma4_multi_image_batch,
    gemma4_ragged_batch,
    tiny_gemma4,
    tiny_gemma4_e2b,
    tiny_gemma4_moe,
)
from tests.helpers.tiny_glm4v import (
    glm4v_batch,
    glm4v_multi_image_batch,
    glm4v_ragged_batch,
    glm4v_video_batch,
    tiny_glm4v,
)
from tests.helpers.tiny_glm46v import tiny_glm46v, tiny_glm46v_moe
from tests.helpers.tiny_internvl_smolvlm import (
    internvl_batch,
    internvl_multi_image_batch,
    internvl_ragged_batch,
    internvl_tiles_batch,
    smolvlm_batch,
    smolvlm_multi_image_batch,
    smolvlm_ragged_batch,
    tiny_idefics3,
    tiny_internvl,
    tiny_smolvlm,
)
from tests.helpers.tiny_llama4 import (
    llama4_batch,
    llama4_multi_image_batch,
    llama4_ragged_batch,
    tiny_llama4,
)
from tests.helpers.tiny_llava_family import (
    llava_next_batch,
    llava_next_ragged_batch,
    llava_onevision_batch,
    llava_onevision_multi_image_batch,
    llava_onevision_video_batch,
    tiny_llava_next,
    tiny_llava_onevision,
    tiny_video_llava,
    video_llava_batch,
    video_llava_multi_image_batch,
    video_llava_video_batch,
)
from tests.helpers.tiny_llava_onevision1_5 import (
    llava_onevision1_5_batch,
    llava_onevision1_5_multi_image_batch,
    llava_onevision1_5_ragged_batch,
    llava_onevision1_5_video_batch,
    tiny_llava_onevision1_5,
)
from tests.helpers.tiny_minicpmv import (
    minicpmv_4x_batch,
    minicpmv_batch,
    minicpmv_multi_image_batch,
    minicpmv_ragged_batch,
    tiny_minicpmv4_6,
    tiny_minicpmv4_7,
)
from tests.helpers.tiny_mistral3 import (
    mistral3_batch,
    mistral3_multi_image_batch,
    mistral3_ragged_batch,
    tiny_mistral3,
)
from tests.helpers.tiny_molmo2 import (
    molmo2_batch,
    molmo2_multi_image_batch,
    molmo2_ragged_batch,
    tiny_molmo2,
)
from tests.helpers.tiny_qwen3_5 import tiny_qwen3_5, tiny_qwen3_5_moe
from tests.helpers.tiny_qwen3_vl import (
    qwen3_vl_batch,
    qwen3_vl_multi_image_batch,
    qwen3_vl_ragged_batch,
    qwen3_vl_video_batch,
    tiny_qwen3_vl,
    tiny_qwen3_vl_moe,
)

BatchBuilder = Callable[[PreTrainedModel, int], Batch]

FAMILIES: dict[str, tuple[Callable[[], PreTrainedModel], BatchBuilder]] = {
    "llava": (tiny_llava, llava_batch),
    "qwen2.5-vl": (tiny_qwen2_5_vl, qwen_batch_12),
    "qwen2-vl": (tiny_qwen2_vl, qwen_batch_12),
    "llava-next": (tiny_llava_next, llava_next_batch),
    "llava-onevision": (tiny_llava_onevision, llava_onevision_batch),
    "video-llava": (tiny_video_llava, video_llava_batch),
    "qwen3-vl": (tiny_qwen3_vl, qwen3_vl_batch),
    "qwen3-vl-moe": (tiny_qwen3_vl_moe, qwen3_vl_batch),
    "internvl": (tiny_internvl, internvl_batch),
    "smolvlm": (tiny_smolvlm, smolvlm_batch),
    "idefics3": (tiny_idefics3, smolvlm_batch),
    "mistral3": (tiny_mistral3, mistral3_batch),
    "glm4v": (tiny_glm4v, glm4v_batch),
    "qwen3.5": (tiny_qwen3_5, qwen3_vl_batch),
    "qwen3.5-moe": (tiny_qwen3_5_moe, qwen3_vl_batch),
    "gemma3": (tiny_gemma3, gemma3_batch),
    "llama4": (tiny_llama4, llama4_batch),
    "llava-onevision-1.5": (tiny_llava_onevision1_5, llava_onevision1_5_batch),
    "glm46v": (tiny_glm46v, glm4v_batch),
    "glm46v-moe": (tiny_glm46v_moe, glm4v_batch),
    "gemma4": (tiny_gemma4, gemma4_batch),
    "gemma4-e2b": (tiny_gemma4_e2b, gemma4_batch),
    "gemma4-moe": (tiny_gemma4_moe, gemma4_batch),
    "minicpm-v-4.6": (tiny_minicpmv4_6, minicpmv_batch),
    "minicpm-v-4.7": (tiny_minicpmv4_7, minicpmv_batch),
    "molmo2": (tiny_molmo2, molmo2_batch),
}
"""Every supported family: (model builder, batch builder)."""

LAYOUTS: dict[str, dict[str, BatchBuilder]] = {
    "llava": {"two images": lambda model, size: llava_batch(model, size, images=2)},
    "qwen2.5-vl": {
        "ragged": lambda model, size: qwen_batch(model, size, grid=[(1, 4, 4), (1, 4, 8)][:size]),
        "video": qwen_video_batch,
    },
    "qwen2-vl": {"video": qwen_video_batch},
    "llava-next": {"ragged": llava_next_ragged_batch},
    "llava-onevision": {
        "video": llava_onevision_video_batch,
        "two images": llava_onevision_multi_image_batch,
    },
    "video-llava": {"video": video_llava_video_batch, "image + video": video_llava_multi_image_batch},
    "qwen3-vl": {
        "ragged": qwen3_vl_ragged_batch,
        "video": qwen3_vl_video_batch,
        "image + video": lambda model, size: qwen3_vl_video_batch(model, size, with_image=True),
        "two images": qwen3_vl_multi_image_batch,
    },
    "internvl": {
        "tiles": internvl_tiles_batch,
        "ragged": internvl_ragged_batch,
        "two images": internvl_multi_image_batch,
    },
    "smolvlm": {"ragged": smolvlm_ragged_batch, "two images": smolvlm_multi_image_batch},
    "mistral3": {"ragged": mistral3_ragged_batch, "two images": mistral3_multi_image_batch},
    "glm4v": {
        "ragged": glm4v_ragged_batch,
        "video": glm4v_video_batch,
        "two images": glm4v_multi_image_batch,
    },
    "qwen3.5": {
        "ragged": qwen3_vl_ragged_batch,
        "video": qwen3_vl_video_batch,
        "two images": qwen3_vl_multi_image_batch,
    },
    "gemma3": {"ragged": gemma3_ragged_batch, "two images": gemma3_multi_image_batch},
    "llama4": {"ragged": llama4_ragged_batch, "two images": llama4_multi_image_batch},
    "llava-onevision-1.5": {
        "ragged": llava_onevision1_5_ragged_batch,
        "video": llava_onevision1_5_video_batch,
        "two images": llava_onevision1_5_multi_image_batch,
    },
    "glm46v": {
        "ragged": glm4v_ragged_batch,
        "video": glm4v_video_batch,
        "two images": glm4v_multi_image_batch,
    },
    "glm46v-moe": {"video": glm4v_video_batch},
    "gemma4": {"ragged": gemma4_ragged_batch, "two images": gemma4_multi_image_batch},
    "gemma4-e2b": {"ragged": gemma4_ragged_batch, "two images": gemma4_multi_image_batch},
    "gemma4-moe": {"ragged": gemma4_ragged_batch, "two images": gemma4_multi_image_batch},
    "minicpm-v-4.6": {
        "ragged": minicpmv_ragged_batch,
        "two images": minicpmv_multi_image_batch,
        "4x": minicpmv_4x_batch,
    },
    "minicpm-v-4.7": {"ragged": minicpmv_ragged_batch, "two images": minicpmv_multi_image_batch},
    "molmo2": {"ragged": molmo2_ragged_batch, "two images": molmo2_multi_image_batch},
}
"""Further prompt layouts per family: {family: {layout: batch builder}}."""


def setup(family: str, batch_size: int) -> tuple[PreTrainedModel, Batch]:
    """A tiny float64 model of ``family`` and a left-padded batch for it."""
    build, make_batch = FAMILIES[family]
    model = build()
    return model, make_batch(model, batch_size=batch_size)


def skip_unless_stock_runs_static(model: PreTrainedModel) -> None:
    """Skip a static-cache test where transformers' own ``generate(cache_implementation="static")`` fails
    for ``model``: at 5.17 generate passes ``block_sequence_ids`` to every layer type's mask builder, and
    ``create_chunked_causal_mask`` (Llama 4's chunked layers) takes none (a TypeError before any layer
    runs, pruning attached or not)."""
    kinds = getattr(model.config.get_text_config(), "layer_types", None) or []
    builder = inspect.signature(masking_utils.create_chunked_causal_mask).parameters
    if "chunked_attention" in kinds and "block_sequence_ids" not in builder:
        pytest.skip("this transformers release cannot generate with a static cache for chunked attention")


GEMMA4_STATIC_WINDOW_CHECKED = "5.25.0"
"""The first release on which Gemma 4's left-padded rows and window-edge decoding on a static cache were
seen to equal the masked reference."""


def skip_gemma4_static_window_before_checked(model: PreTrainedModel) -> None:
    """Skip Gemma 4 with left-padded rows or decoding past its sliding window on a static cache before
    ``GEMMA4_STATIC_WINDOW_CHECKED``: on transformers 5.17.0 (CI's floor run, 2026-12-06) the pruned run
    keeps other tokens than the masked reference there (the dynamic cache and the static cache without
    padding or window edge agree); 5.25.0 agrees; releases between were not run and the cause is not known
    (docs/families.md, Gemma 4)."""
    old = Version(transformers.__version__) < Version(GEMMA4_STATIC_WINDOW_CHECKED)
    if model.config.model_type == "gemma4" and old:
        pytest.skip(
            f"Gemma 4's padded or window-edge static-cache runs are checked from transformers "
            f"{GEMMA4_STATIC_WINDOW_CHECKED} only (5.17.0 disagrees with the reference; not investigated)"
        )
