"""A complete, loadable tiny LLaVA checkpoint directory, built offline, for end-to-end CLI tests.

``save_tiny_llava_checkpoint(path)`` writes what ``AutoProcessor.from_pretrained`` and
``AutoModelForImageTextToText.from_pretrained`` need: the random ``tiny.tiny_llava`` model in float32,
and a ``LlavaProcessor`` made of a 28x28 ``CLIPImageProcessor``, a word-level tokenizer whose ids match the
model's vocabulary (``<image>`` = 199, pad 0, bos 1, eos 2) and a chat template. Nothing touches the network.

The chat template renders ``<s>USER: <image>\\n{text} ASSISTANT:``, so after the processor expands
``<image>`` to 16 image tokens the prompt reads ``<s> USER: <image>x16 \\n word.. ASSISTANT:``: the newline
is the separator token right after the image, and the question follows it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlavaProcessor, PreTrainedTokenizerFast

from tests.helpers.tiny import (
    BOS_ID,
    EOS_ID,
    LLAVA_IMAGE_ID,
    LLAVA_IMAGE_SIZE,
    LLAVA_PATCH_SIZE,
    PAD_ID,
    VOCAB,
    tiny_llava,
)

try:  # without torchvision, transformers 5 falls back to the PIL backend and warns; ask for it directly
    from transformers import CLIPImageProcessorPil as CLIPImageProcessor
except ImportError:  # pragma: no cover - torchvision installed, or an older transformers
    from transformers import CLIPImageProcessor

UNK_ID, NEWLINE_ID, USER_ID, ASSISTANT_ID = 3, 4, 5, 6
WORDS = (
    "what",
    "is",
    "in",
    "the",
    "image",
    "a",
    "this",
    "picture",
    "describe",
    "color",
    "red",
    "blue",
    "cat",
)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: "
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% else %} ASSISTANT: {{ message['content'][0]['text'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)


def _vocab() -> dict[str, int]:
    """VOCAB entries: the specials, a few real words, filler words ``w<id>``, and ``<image>`` last."""
    fixed = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID, "<unk>": UNK_ID, "\n": NEWLINE_ID}
    fixed |= {"USER:": USER_ID, "ASSISTANT:": ASSISTANT_ID, "<image>": LLAVA_IMAGE_ID}
    free = [i for i in range(VOCAB) if i not in fixed.values()]
    words = [*WORDS, *(f"w{i}" for i in free[len(WORDS) :])]
    return fixed | dict(zip(words, free, strict=True))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer; ``<image>`` and ``\\n`` are added tokens, so need no spaces."""
    backend = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )
    tokenizer.add_tokens(["\n"])
    return tokenizer


def save_tiny_llava_checkpoint(path: str | Path) -> Path:
    """Write the tiny model and its processor to ``path`` (created if needed); return the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_llava(dtype=torch.float32)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.save_pretrained(path)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": LLAVA_IMAGE_SIZE},
        crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=build_tokenizer(),
        patch_size=LLAVA_PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, which "default" drops again: 16 image tokens
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    return path


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.helpers.checkpoint OUTPUT_DIR")
    print(save_tiny_llava_checkpoint(sys.argv[1]))
