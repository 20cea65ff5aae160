"""The testbed's shape: a LLaVA-1.5-style ``LlavaForConditionalGeneration`` around SmolLM2-135M-Instruct.

The vision tower is a small CLIP ViT trained from scratch (192 px images, 8 px patches: a 24 x 24 grid of
576 visual tokens, as LLaVA-1.5, so the paper's budgets 192 / 128 / 64 keep the same fractions); the
projector is LLaVA's 2-layer GELU MLP. The image token is one token added to SmolLM2's vocabulary.
"""

from __future__ import annotations

from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

IMAGE_SIZE = 192
PATCH_SIZE = 8
GRID = IMAGE_SIZE // PATCH_SIZE
IMAGE_TOKEN = "<image>"
# One chat turn per question; the "\n" after the image run is the separator PriorTR reads its prior from.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def vision_config() -> CLIPVisionConfig:
    return CLIPVisionConfig(
        hidden_size=192,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=192,
    )


def llava_config(text_config: LlamaConfig, image_token_id: int) -> LlavaConfig:
    """``text_config`` is SmolLM2's, with the vocabulary already grown by the image token."""
    return LlavaConfig(
        vision_config=vision_config(),
        text_config=text_config,
        image_token_id=image_token_id,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=GRID * GRID,
        tie_word_embeddings=text_config.tie_word_embeddings,
    )
