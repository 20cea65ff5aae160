"""Chat prompts about images, built one way for every front end.

A prompt is one user turn of the processor's chat template: the image placeholder(s) first, then the
question, then the generation prompt. ``prompt_text`` renders it as text (for batched
``processor(images=..., text=...)`` calls: ``priortr eval``, ``priortr calibrate``, the lmms-eval
plug-in); ``chat_inputs`` tokenises it with its image for one question (``priortr generate`` and
``viz``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def user_turn(question: str, images: Sequence[Any]) -> list[dict[str, Any]]:
    """The chat messages: one user turn holding ``images`` (None: a placeholder only) and ``question``."""
    content = [{"type": "image"} if image is None else {"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": [*content, {"type": "text", "text": question}]}]


def prompt_text(processor: Any, question: str, n_images: int = 1) -> str:
    """The chat-template text of ``question`` after ``n_images`` image placeholders, generation prompt
    included (the processor expands each placeholder to the image's tokens)."""
    return processor.apply_chat_template(
        user_turn(question, [None] * n_images), add_generation_prompt=True, tokenize=False
    )


def chat_inputs(processor: Any, image: Any, prompt: str, model: nn.Module) -> dict:
    """The processor's chat-template inputs for one image and one question, on the model's device.

    The question must pass :func:`check_prompt`.
    """
    check_prompt(processor, prompt)
    return processor.apply_chat_template(
        user_turn(prompt, [image]),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    ).to(model.device, dtype=model.dtype)  # only floating tensors (pixels) are cast


def check_text(text: str, what: str) -> None:
    """Refuse ``text`` that UTF-8 cannot encode, so no tokenizer can: bytes that are not UTF-8 (which
    Python hands on from the command line as lone surrogates, ``surrogateescape``) or a lone surrogate
    (a JSON ``"\\ud800"`` escape). ``what`` names where the text came from."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        escaped = 0xDC80 <= char <= 0xDCFF  # surrogateescape's stand-in for the byte char - 0xDC00
        found = f"byte 0x{char - 0xDC00:02x}" if escaped else f"a lone surrogate U+{char:04X}"
        raise ValueError(
            f"{what} is not valid UTF-8 text ({found} at character {exc.start}); pass it as UTF-8 "
            "(set the terminal or file encoding to UTF-8, or convert it with iconv -t UTF-8)"
        ) from None


def check_prompt(processor: Any, prompt: str) -> None:
    """Refuse a question that is not real text: with none, the posterior P would average the chat
    template's own tokens and pruning would run on them without a word; text UTF-8 cannot encode would
    fail in the tokenizer (``check_text``); an image placeholder of ``processor`` typed into it would ask
    for a second image."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(
            f"the prompt is empty ({prompt!r}): the methods rank the image by the instruction's attention, "
            "so pass the question to ask about the image"
        )
    check_text(prompt, "the prompt")
    placeholders = {getattr(processor, name, None) for name in ("image_token", "video_token")} - {None, ""}
    typed = sorted(token for token in placeholders if token in prompt)
    if typed:
        raise ValueError(
            f"the prompt contains {', '.join(map(repr, typed))}: the chat template places the image itself; "
            "pass the question text only"
        )
