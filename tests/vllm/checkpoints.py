"""Tiny random-weight LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, InternVL, LLaVA-OneVision, LLaVA-NeXT,
Mistral 3, GLM-4.1V and Gemma 3 checkpoints that vLLM's CPU build can load, built offline.

vLLM's CPU attention takes head sizes 32, 64, 80, ... only, so the text models here have hidden size
128 over 4 heads (head_dim 32). The weights are drawn wider than transformers' default (std 0.02)
so that greedy tokens depend visibly on which visual tokens are kept, and near-ties between the two
engines' float32 logits are unlikely.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    Glm4vForConditionalGeneration,
    Glm4vImageProcessorPil,
    Glm4vProcessor,
    Glm4vVideoProcessor,
    GotOcr2ImageProcessorPil,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLProcessor,
    InternVLVideoProcessor,
    LlamaConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessorPil,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralImageProcessorPil,
    PixtralProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLProcessor,
    Qwen2Config,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3Config,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from tests.helpers import checkpoint
from tests.helpers.tiny import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    QWEN_IMAGE_ID,
    QWEN_VIDEO_ID,
    QWEN_VISION_END_ID,
    QWEN_VISION_START_ID,
    VOCAB,
    tiny_qwen2_5_vl,
    tiny_qwen2_vl,
)
from tests.helpers.tiny_glm4v import (
    GLM_IMAGE_END_ID,
    GLM_IMAGE_ID,
    GLM_IMAGE_START_ID,
    GLM_VIDEO_END_ID,
    GLM_VIDEO_ID,
    GLM_VIDEO_START_ID,
    tiny_glm4v,
)
from tests.helpers.tiny_internvl_smolvlm import (
    INTERNVL_END_ID,
    INTERNVL_IMAGE_ID,
    INTERNVL_START_ID,
    tiny_idefics3,
)
from tests.helpers.tiny_mistral3 import MISTRAL3_BREAK_ID, MISTRAL3_END_ID, MISTRAL3_IMAGE_ID
from tests.helpers.tiny_qwen3_vl import tiny_qwen3_vl, tiny_qwen3_vl_moe

TEXT = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
QWEN_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}  # sums to 32 / 2
QWEN3_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [6, 5, 5],
    "mrope_interleaved": True,
}
WEIGHT_STD = 0.08
WORD_SPECIALS = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID, "<unk>": 3, "\n": 4}  # word tokenizers' ids
QWEN_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: "
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)


def _widen(path: Path, seed: int, vision: tuple[str, ...] = (), clip_names: bool = False) -> None:
    """Redraw the language model's and projector's matrices (a MoE's experts stacked [E, ., .] too) with
    std ``WEIGHT_STD`` (norms untouched), and the vision tower's whose names hold one of ``vision``;
    ``clip_names``: name a CLIP tower's weights as the llava-hf checkpoints do
    (``vision_tower.vision_model.*``, which vLLM's loader expects and transformers reads too)."""
    file = path / "model.safetensors"
    weights = load_file(file)
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in weights.items():
        tower = "vision_tower" in name or "visual" in name
        if value.ndim in (2, 3) and (not tower or any(part in name for part in vision)):
            value = torch.randn(value.shape, generator=generator) * WEIGHT_STD
        clip = name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model.")
        if clip_names and clip:
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        out[name] = value
    save_file(out, file, metadata={"format": "pt"})


def llava(path: str | Path) -> Path:
    """LLaVA-1.5 (CLIP tower, 16 visual tokens per 28x28 image) with a 4-layer head_dim-32 Llama."""
    original = checkpoint.tiny_llava
    checkpoint.tiny_llava = lambda dtype: original(dtype=dtype, text=TEXT)
    try:
        path = checkpoint.save_tiny_llava_checkpoint(path)
    finally:
        checkpoint.tiny_llava = original
    _widen(path, seed=1, clip_names=True)
    return path


def qwen2_vl(path: str | Path) -> Path:
    """Qwen2-VL with a 4-layer head_dim-32 text model; a 56x56 image is 4 visual tokens, 112x112 is 16."""
    return _qwen(Path(path), tiny_qwen2_vl, "hidden_size", Qwen2VLProcessor, seed=2)


def qwen2_5_vl(path: str | Path) -> Path:
    """Qwen2.5-VL (windowed vision blocks) with the same text model and image sizes as ``qwen2_vl``."""
    return _qwen(Path(path), tiny_qwen2_5_vl, "out_hidden_size", Qwen2_5_VLProcessor, seed=3)


def qwen3_vl(path: str | Path) -> Path:
    """Qwen3-VL with a 4-layer head_dim-32 text model (q/k norms, interleaved M-RoPE) and DeepStack
    features added to the outputs of decoder layers 0 and 1 (``tests.helpers.tiny_qwen3_vl``); patches
    of 16 px, so a 64x64 image is 4 visual tokens and 128x128 is 16. The DeepStack mergers are drawn
    wide too: at transformers' default std the features are too small to change a greedy answer."""
    return _qwen(
        Path(path),
        tiny_qwen3_vl,
        "out_hidden_size",
        Qwen3VLProcessor,
        seed=4,
        patch=16,
        vision=("deepstack_merger_list",),
        text={"head_dim": TEXT["hidden_size"] // TEXT["num_attention_heads"], "rope_parameters": QWEN3_ROPE},
        video=lambda low, high: Qwen3VLVideoProcessor(size={"shortest_edge": low, "longest_edge": high}),
    )


def qwen3_vl_moe(path: str | Path) -> Path:
    """Qwen3-VL MoE, laid out as ``qwen3_vl``: decoder layer 0 has a dense MLP, layers 1-3 a 4-expert
    top-2 MoE block (``tests.helpers.tiny_qwen3_vl``); the DeepStack mergers and the experts are drawn
    wide too (at transformers' default std neither changes a greedy answer visibly). The text config
    says ``norm_topk_prob`` as the released checkpoints do: vLLM reads it, while transformers' config
    class dropped it (its router always renormalises the top-k weights). The experts are stored as the
    released checkpoints store them, [E, D, 2I] and [E, I, D], which vLLM reads and transformers
    transposes on load; transformers saves its own [E, 2I, D] / [E, D, I]."""
    path = _qwen(
        Path(path),
        tiny_qwen3_vl_moe,
        "out_hidden_size",
        Qwen3VLProcessor,
        seed=5,
        patch=16,
        vision=("deepstack_merger_list",),
        text={
            "head_dim": TEXT["hidden_size"] // TEXT["num_attention_heads"],
            "rope_parameters": QWEN3_ROPE,
            "norm_topk_prob": True,
        },
        video=lambda low, high: Qwen3VLVideoProcessor(size={"shortest_edge": low, "longest_edge": high}),
    )
    store_experts_as_released(path)
    return path


def store_experts_as_released(path: Path) -> None:
    """Rewrite the MoE experts of the checkpoint at ``path`` from transformers' saved [E, 2I, D] /
    [E, D, I] to the released checkpoints' [E, D, 2I] / [E, I, D], which vLLM reads (transformers
    transposes them on load)."""
    for file in sorted(path.glob("*.safetensors")):
        weights = load_file(file)
        released = {
            name: value.transpose(1, 2).contiguous() if ".mlp.experts." in name else value
            for name, value in weights.items()
        }
        save_file(released, file, metadata={"format": "pt"})


# half of each 32-wide head rotates: 8 frequencies, split 2 (temporal) + 3 (height) + 3 (width)
GLM4V_ROPE = {**QWEN_ROPE, "mrope_section": [2, 3, 3], "partial_rotary_factor": 0.5}
GLM4V_TEMPLATE = QWEN_TEMPLATE.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "<|begin_of_image|><|image|><|end_of_image|>"
)


def glm4v(path: str | Path) -> Path:
    """GLM-4.1V (``tests.helpers.tiny_glm4v``'s 2-block tower, patches of 14 px merged 2 x 2) with a
    4-layer head_dim-32 GLM-4 text model (sandwich norms, RoPE over half of each head); images are
    resized to 4x4 .. 8x8 patches, so a 56x56 image is 4 visual tokens and 112x112 is 16, each written
    ``<|begin_of_image|> <|image|> x N <|end_of_image|>`` as ``Glm4vProcessor`` writes it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_glm4v(dtype=torch.float32).config
    for key, value in {**TEXT, "rope_parameters": GLM4V_ROPE}.items():
        setattr(config.text_config, key, value)
    config.vision_config.out_hidden_size = TEXT["hidden_size"]
    torch.manual_seed(0)
    model = Glm4vForConditionalGeneration._from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    model.eval().save_pretrained(path)
    frames, patch = 2, 14  # an image is one temporal patch of two copies of itself
    size = {"shortest_edge": frames * (4 * patch) ** 2, "longest_edge": frames * (8 * patch) ** 2}
    special = {
        **WORD_SPECIALS,
        "<|image|>": GLM_IMAGE_ID,
        "<|video|>": GLM_VIDEO_ID,
        "<|begin_of_image|>": GLM_IMAGE_START_ID,
        "<|end_of_image|>": GLM_IMAGE_END_ID,
        "<|begin_of_video|>": GLM_VIDEO_START_ID,
        "<|end_of_video|>": GLM_VIDEO_END_ID,
    }
    names = {
        "image_token": "<|image|>",
        "video_token": "<|video|>",
        "image_start_token": "<|begin_of_image|>",
        "image_end_token": "<|end_of_image|>",
        "video_start_token": "<|begin_of_video|>",
        "video_end_token": "<|end_of_video|>",
    }
    processor = Glm4vProcessor(
        image_processor=Glm4vImageProcessorPil(size=size, patch_size=patch),
        video_processor=Glm4vVideoProcessor(size=size, max_image_size={"longest_edge": size["longest_edge"]}),
        tokenizer=_word_tokenizer(special, names),
        chat_template=GLM4V_TEMPLATE,
    )
    processor.save_pretrained(path)
    _widen(path, seed=11)
    return path


def idefics3(path: str | Path) -> Path:
    """Idefics3's config and weights (``tests.helpers.tiny_internvl_smolvlm``), no processor: a family the
    plug-in does not serve, whose engine config vLLM builds (the refusal is made there)."""
    path = Path(path)
    tiny_idefics3(dtype=torch.float32).save_pretrained(path)
    return path


INTERNVL_TILE, INTERNVL_PATCH = 56, 7
INTERNVL_TILE_TOKENS = (INTERNVL_TILE // INTERNVL_PATCH // 2) ** 2  # 8x8 patches, 2x2 pixel shuffle: 16
INTERNVL_VIDEO_ID = 196
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: "
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<IMG_CONTEXT>\n{% endif %}"
    "{% endfor %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)


def internvl(path: str | Path, text_model: str = "qwen2") -> Path:
    """InternVL in the Hugging Face format (``InternVLForConditionalGeneration``): a 2-layer InternViT
    (head_dim 32) and a 4-layer head_dim-32 Qwen2 (InternVL 2.5 / 3; ``text_model="qwen3"``: Qwen3, with
    q/k norms, as InternVL3.5); tiles of 56 px, 16 visual tokens each, up to 4 crops and a thumbnail per
    image: a 56x56 image is one tile (16 tokens), 112x56 two crops and the thumbnail (48 tokens),
    112x112 four crops and the thumbnail (80 tokens)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vision = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": INTERNVL_TILE,
        "patch_size": INTERNVL_PATCH,
    }
    text_settings = {
        **TEXT,
        "vocab_size": VOCAB,
        "num_hidden_layers": 4,
        "max_position_embeddings": 512,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": False,
    }
    if text_model == "qwen3":
        text = Qwen3Config(head_dim=TEXT["hidden_size"] // TEXT["num_attention_heads"], **text_settings)
    else:
        text = Qwen2Config(**text_settings)
    config = InternVLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=INTERNVL_IMAGE_ID,
        image_seq_length=INTERNVL_TILE_TOKENS,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration._from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    model.eval().save_pretrained(path)
    tile = {"height": INTERNVL_TILE, "width": INTERNVL_TILE}
    processor = InternVLProcessor(
        image_processor=GotOcr2ImageProcessorPil(
            size=tile, crop_to_patches=True, min_patches=1, max_patches=4
        ),
        tokenizer=_internvl_tokenizer(),
        video_processor=InternVLVideoProcessor(size=tile),
        image_seq_length=INTERNVL_TILE_TOKENS,
        chat_template=INTERNVL_TEMPLATE,
    )
    processor.save_pretrained(path)
    _widen(path, seed=6 if text_model == "qwen2" else 7)
    return path


ONEVISION_CROP, ONEVISION_PATCH = 28, 7  # 4x4 patches per crop
ONEVISION_IMAGE_ID, ONEVISION_VIDEO_ID = 199, 198


def llava_onevision(path: str | Path) -> Path:
    """LLaVA-OneVision: a 2-layer SigLIP (head_dim 32, 28-px crops of 4x4 patches, no [CLS]) and a 4-layer
    head_dim-32 Qwen2; AnyRes pinpoints of 1..3 x 1..3 crops and ``anyres_max_9`` (vLLM counts an
    image's tokens with 9): a 28x28 image is its base crop (16) + one 4x4 crop with 4 newlines (36
    tokens), 56x28 (w x h) 16 + 4x8 + 4 (52)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vision = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": ONEVISION_CROP,
        "patch_size": ONEVISION_PATCH,
        "vision_use_head": False,
    }
    text = Qwen2Config(
        **TEXT,
        vocab_size=VOCAB,
        num_hidden_layers=4,
        max_position_embeddings=512,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    pinpoints = [[ONEVISION_CROP * i, ONEVISION_CROP * j] for i in (1, 2, 3) for j in (1, 2, 3)]
    config = LlavaOnevisionConfig(
        vision_config={"model_type": "siglip_vision_model", **vision},
        text_config=text,
        image_token_id=ONEVISION_IMAGE_ID,
        video_token_id=ONEVISION_VIDEO_ID,
        image_grid_pinpoints=pinpoints,
        vision_aspect_ratio="anyres_max_9",
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlavaOnevisionForConditionalGeneration._from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    model.eval().save_pretrained(path)
    crop = {"height": ONEVISION_CROP, "width": ONEVISION_CROP}
    special = {**WORD_SPECIALS, "<image>": ONEVISION_IMAGE_ID, "<video>": ONEVISION_VIDEO_ID}
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessorPil(size=crop, image_grid_pinpoints=pinpoints),
        tokenizer=_word_tokenizer(special, {"image_token": "<image>", "video_token": "<video>"}),
        video_processor=LlavaOnevisionVideoProcessor(size=crop),
        num_image_tokens=(ONEVISION_CROP // ONEVISION_PATCH) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9",
        chat_template=QWEN_TEMPLATE,
    )
    processor.save_pretrained(path)
    _widen(path, seed=8, vision=("mlp", "self_attn"), clip_names=True)
    return path


NEXT_CROP, NEXT_PATCH = 28, 7  # 4x4 patches per crop
NEXT_IMAGE_ID = 199


def llava_next(path: str | Path) -> Path:
    """LLaVA-NeXT: a 2-layer CLIP (head_dim 32, 28-px crops of 4x4 patches, [CLS] dropped) and a 4-layer
    head_dim-32 Llama; AnyRes pinpoints of 1..2 x 1..2 crops: a 28x28 image is its base crop (16) + one
    4x4 crop with 4 newlines (36 tokens), 56x28 (w x h) 16 + 4x8 + 4 (52), 56x56 16 + 8x8 + 8 (88)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": NEXT_CROP,
        "patch_size": NEXT_PATCH,
        "projection_dim": 64,
    }
    text = LlamaConfig(
        **TEXT,
        vocab_size=VOCAB,
        num_hidden_layers=4,
        max_position_embeddings=512,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    pinpoints = [[NEXT_CROP * i, NEXT_CROP * j] for i in (1, 2) for j in (1, 2)]
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=NEXT_IMAGE_ID,
        image_grid_pinpoints=pinpoints,
        image_seq_length=(NEXT_CROP // NEXT_PATCH) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration._from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    model.eval().save_pretrained(path)
    crop = {"height": NEXT_CROP, "width": NEXT_CROP}
    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(
            size={"shortest_edge": NEXT_CROP}, crop_size=crop, image_grid_pinpoints=pinpoints
        ),
        tokenizer=_word_tokenizer({**WORD_SPECIALS, "<image>": NEXT_IMAGE_ID}, {"image_token": "<image>"}),
        patch_size=NEXT_PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=QWEN_TEMPLATE,
    )
    processor.save_pretrained(path)
    _widen(path, seed=10, vision=("mlp", "self_attn"), clip_names=True)
    return path


MISTRAL3_PATCH, MISTRAL3_MERGE, MISTRAL3_LONGEST = 8, 2, 64
MISTRAL3_TOKEN_PIXELS = MISTRAL3_PATCH * MISTRAL3_MERGE  # one visual token covers 16 x 16 pixels


def mistral3(path: str | Path, sliding_window: int | None = None) -> Path:
    """Mistral 3: a 2-layer Pixtral tower (head_dim 32, 8-px patches merged 2 x 2: one token per 16 x 16
    px, native aspect ratio, longest edge 64 px) and a 4-layer head_dim-32 Mistral; an image of
    ``H x W`` px (multiples of 16) is ``H / 16`` rows of ``W / 16`` ``[IMG]`` tokens, a row break after
    each row and ``[IMG_END]`` last: 32 x 48 is 2 x 3 tokens, 64 x 32 is 4 x 2, 64 x 64 is 4 x 4;
    ``sliding_window``: the text model's (Mistral Small 3.1 / 3.2 have none)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vision = {
        "model_type": "pixtral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 32,
        "image_size": MISTRAL3_LONGEST,
        "patch_size": MISTRAL3_PATCH,
    }
    text = MistralConfig(
        **TEXT,
        head_dim=TEXT["hidden_size"] // TEXT["num_attention_heads"],
        vocab_size=VOCAB,
        num_hidden_layers=4,
        max_position_embeddings=512,
        sliding_window=sliding_window,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    config = Mistral3Config(
        vision_config=vision,
        text_config=text,
        image_token_index=MISTRAL3_IMAGE_ID,
        spatial_merge_size=MISTRAL3_MERGE,
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        multimodal_projector_bias=False,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration._from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    model.eval().save_pretrained(path)
    special = {
        **WORD_SPECIALS,
        "[IMG]": MISTRAL3_IMAGE_ID,
        "[IMG_BREAK]": MISTRAL3_BREAK_ID,
        "[IMG_END]": MISTRAL3_END_ID,
    }
    names = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessorPil(
            size={"longest_edge": MISTRAL3_LONGEST},
            patch_size={"height": MISTRAL3_TOKEN_PIXELS, "width": MISTRAL3_TOKEN_PIXELS},
        ),
        tokenizer=_word_tokenizer(special, names),
        patch_size=MISTRAL3_PATCH,
        spatial_merge_size=MISTRAL3_MERGE,
        chat_template=QWEN_TEMPLATE,
    )
    processor.save_pretrained(path)
    _widen(path, seed=9, vision=("attention", "feed_forward"))
    return path


GEMMA3_IMAGE = 32  # px: 8x8 SigLIP patches of 4 px, pooled 2x2 to 4x4 = GEMMA3_TOKENS tokens
GEMMA3_TOKENS = 16
GEMMA3_WINDOW = 32
GEMMA3_IMAGE_ID, GEMMA3_START_ID, GEMMA3_END_ID = 199, 198, 197
GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def gemma3(path: str | Path) -> Path:
    """Gemma 3: a 2-layer SigLIP (32-px images of 8x8 patches pooled to ``GEMMA3_TOKENS`` tokens) and a
    4-layer head_dim-32 text model of sliding (window ``GEMMA3_WINDOW``) and global layers
    (``GEMMA3_LAYERS``) with their own RoPE bases, q/k norms and ``query_pre_attn_scalar`` 32. An image
    is ``<start_of_image> <image_soft_token> x 16 <end_of_image>`` with ``\\n\\n`` around it, as
    ``Gemma3Processor`` writes it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = {
        **TEXT,
        "head_dim": 32,
        "num_hidden_layers": len(GEMMA3_LAYERS),
        "layer_types": GEMMA3_LAYERS,
        "sliding_window": GEMMA3_WINDOW,
        "query_pre_attn_scalar": 32,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    vision = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": GEMMA3_IMAGE,
        "patch_size": 4,
    }
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=GEMMA3_TOKENS,
        boi_token_index=GEMMA3_START_ID,
        eoi_token_index=GEMMA3_END_ID,
        image_token_index=GEMMA3_IMAGE_ID,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration._from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    )
    model.eval().save_pretrained(path)
    # "\n\n" .. "\n\n\n\n" are single tokens, as in Gemma's vocabulary; vLLM's processor looks them up
    newlines = {"\n" * count: 3 + count for count in (2, 3, 4)}
    special = {
        **WORD_SPECIALS,
        **newlines,
        "<image_soft_token>": GEMMA3_IMAGE_ID,
        "<start_of_image>": GEMMA3_START_ID,
        "<end_of_image>": GEMMA3_END_ID,
    }
    images = {
        "image_token": "<image_soft_token>",
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
    }
    size = {"height": GEMMA3_IMAGE, "width": GEMMA3_IMAGE}
    tokenizer = _word_tokenizer(special, images)
    tokenizer.add_tokens(list(newlines))
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size=size),
        tokenizer=tokenizer,
        image_seq_length=GEMMA3_TOKENS,
    )
    processor.save_pretrained(path)
    _widen(path, seed=9, vision=("mlp", "self_attn"), clip_names=True)
    return path


def _internvl_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer with InternVL's image tokens at the tiny config's ids."""
    special = {
        **WORD_SPECIALS,
        "<IMG_CONTEXT>": INTERNVL_IMAGE_ID,
        "<img>": INTERNVL_START_ID,
        "</img>": INTERNVL_END_ID,
        "<video>": INTERNVL_VIDEO_ID,
    }
    images = {
        "context_image_token": "<IMG_CONTEXT>",
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "video_token": "<video>",
    }
    return _word_tokenizer(special, images)


def _qwen(
    path: Path,
    build: Callable,
    merger_width: str,
    processor_class: type,
    seed: int,
    patch: int = 14,
    text: dict[str, Any] | None = None,
    video: Callable[[int, int], Any] = lambda low, high: Qwen2VLVideoProcessor(
        min_pixels=low, max_pixels=high
    ),
    vision: tuple[str, ...] = (),
) -> Path:
    """A tiny Qwen-VL of ``build`` with the head_dim-32 text model (``text`` adds to or replaces its
    settings); ``merger_width`` names the vision config's output width (the text width); images are
    resized to 4x4 .. 8x8 patches of ``patch`` px; ``vision``: as ``_widen``'s."""
    path.mkdir(parents=True, exist_ok=True)
    model = build(dtype=torch.float32)
    config = model.config
    for key, value in {**TEXT, "rope_parameters": QWEN_ROPE, **(text or {})}.items():
        setattr(config.text_config, key, value)
    setattr(config.vision_config, merger_width, TEXT["hidden_size"])
    torch.manual_seed(0)
    model = type(model)._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.save_pretrained(path)
    low, high = (4 * patch) ** 2, (8 * patch) ** 2
    processor = processor_class(
        image_processor=Qwen2VLImageProcessorPil(patch_size=patch, min_pixels=low, max_pixels=high),
        video_processor=video(low, high),
        tokenizer=qwen_tokenizer(),
        chat_template=QWEN_TEMPLATE,
    )
    processor.save_pretrained(path)
    _widen(path, seed=seed, vision=vision)
    return path


def qwen_tokenizer(size: int = VOCAB) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer of ``size`` ids whose vision tokens have the tiny Qwen config's
    ids (the serving benchmark's Qwen3-VL layout takes it at Qwen3-VL's vocabulary size)."""
    special = {
        **WORD_SPECIALS,
        "<|vision_start|>": QWEN_VISION_START_ID,
        "<|vision_end|>": QWEN_VISION_END_ID,
        "<|video_pad|>": QWEN_VIDEO_ID,
        "<|image_pad|>": QWEN_IMAGE_ID,
    }
    vision = {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
    }
    return _word_tokenizer(special, vision, size)


def _word_tokenizer(
    special: dict[str, int], vision: dict[str, str], size: int = VOCAB
) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``size`` ids: the ``special`` tokens at their ids (the
    pad, bos, eos, unk and newline ones first), the test words and fillers on the free ids; ``vision``
    names the family's vision tokens (special tokens, so they need no spaces around them)."""
    taken = set(special.values())
    free = [i for i in range(size) if i not in taken]
    words = [*checkpoint.WORDS, "USER:", "ASSISTANT:"]
    vocab = special | dict(zip(words + [f"w{i}" for i in free[len(words) :]], free, strict=True))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=vision,
    )
    tokenizer.add_tokens(["\n"])
    tokenizer.add_special_tokens({"additional_special_tokens": list(vision.values())})
    return tokenizer
