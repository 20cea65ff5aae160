"""What a pruned request carries across vLLM's processes, each written beside where it is read.

vLLM's processor, scheduler and model run apart (front end, engine core, workers) and share a request
only through what vLLM itself hands on, so a pruned request's plan travels in three vLLM structures:

* **the short prompt**: each image's placeholder range holds its K slots, then the range's text tokens
  (Mistral 3's row breaks, its end marker): written by ``shrink_prompt`` in the processor, read back by
  ``break_rows`` where positions are given (``positions.request_positions``) and where the step is
  planned (``step.plan_step``);
* **the image record** (``ImageRecord``): four CPU-kept fields on each of its image items, written by
  ``with_record`` in the processor and read by ``image_record`` (``recorded_lengths`` for a request's
  two lengths) in the scheduler, its encoder cache and the model's positions, and taken off the
  encoder's inputs by ``take_kept`` (``models.embed_multimodal``);
* **the slot record** (``SlotRecord``): (prompt length, grid height, grid width) in the three M-RoPE
  channels of every one of an image's K slots, whose own positions are never used (layers 0..L run
  on the full prompt): encoded by ``positions.request_positions`` when the request arrives, decoded by
  the step that prefills it (``step.plan_step``).

A record that is missing a field, disagrees with itself or with the request is refused with an error:
it means another plug-in or a cache changed what vLLM hands on, and the plan would be wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any

import torch
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PlaceholderRange,
)

PROMPT_LENGTH_KEY = "priortr_prompt_length"
KEPT_KEY = "priortr_kept"
ENCODED_KEY = "priortr_encoded_tokens"
UNPRUNED_LENGTH_KEY = "priortr_unpruned_length"
RECORD_KEYS = (PROMPT_LENGTH_KEY, KEPT_KEY, ENCODED_KEY, UNPRUNED_LENGTH_KEY)
"""The image item's fields that hold an ``ImageRecord``, in the order of its fields."""


@dataclass(frozen=True)
class ImageRecord:
    """What the processor records on each image of a pruned request.

    ``prompt_length``: the request's scheduled prompt (K slots per image), which tells a re-prefill
    after preemption where the prompt ends (Model Runner V2 asks for positions again with the prompt
    and its generated tokens); ``kept_count``: the image's K slots, which ``embed_multimodal`` fills with
    the image's N encoder rows (adjacent images' slots are one run no count in the step separates);
    ``encoded``: the image's N, the embeddings its encoder computes and the scheduler charges;
    ``unpruned_length``: the prompt with every image whole, which bounds the answer (``scheduler.py``).
    """

    prompt_length: int
    kept_count: int
    encoded: int
    unpruned_length: int

    def __post_init__(self) -> None:
        if not (
            1 <= self.kept_count <= min(self.encoded, self.prompt_length)
            and self.prompt_length + self.encoded - self.kept_count <= self.unpruned_length
        ):
            raise RuntimeError(
                f"priortr: an image's record {self} is not one the plug-in's processor writes "
                "(1 <= kept_count <= encoded, kept_count <= prompt_length, "
                "prompt_length + encoded - kept_count <= unpruned_length); "
                "is another plug-in or cache changing the request's image items?"
            )

    def fields(self) -> dict[str, MultiModalFieldElem]:
        """The record as the image item's CPU-kept fields (``with_record``, tests)."""
        return {
            key: MultiModalFieldElem(data=torch.tensor(value), field=MultiModalBatchedField(keep_on_cpu=True))
            for key, value in zip(RECORD_KEYS, astuple(self), strict=True)
        }

    @classmethod
    def of_fields(cls, data: Mapping[str, Any]) -> ImageRecord | None:
        """The record held by an image item's fields ``data`` (each with ``.data``), None for an item
        that holds none (an unpruned request's image); one holding some of the fields is refused."""
        present = [key for key in RECORD_KEYS if key in data]
        if not present:
            return None
        if len(present) < len(RECORD_KEYS):
            raise RuntimeError(
                f"priortr: an image item holds the record fields {present} of {list(RECORD_KEYS)}; is "
                "another plug-in or cache changing the request's image items?"
            )
        return cls(*(int(data[key].data) for key in RECORD_KEYS))


def with_record(item: MultiModalKwargsItem | None, record: ImageRecord) -> MultiModalKwargsItem | None:
    """``item`` (an image of a pruned request) with ``record`` as four more fields.

    The record rides on the image, which every cache keys by the image's identity; that identity holds
    the record's values too (``processor.PruningProcessor.apply``), so requests that share a cached
    item share them. ``None`` (an item vLLM's processor cache already sent to the engine, which has it
    with these fields) stays None."""
    if item is None:
        return None
    return MultiModalKwargsItem({**item, **record.fields()})


def image_record(feature: Any) -> ImageRecord | None:
    """The record of a request's item (vLLM's ``MultiModalFeatureSpec``), None for an item that is not
    an image, whose data vLLM hands on as None, or of an unpruned request."""
    if feature.modality != "image" or feature.data is None:
        return None
    return ImageRecord.of_fields(feature.data)


@dataclass(frozen=True)
class RequestLengths:
    """A pruned request's two lengths, as every one of its images records them: its scheduled prompt
    (K slots per image) and its prompt with every image whole (N per image)."""

    prompt: int
    unpruned: int


def recorded_lengths(mm_features: Sequence[Any]) -> RequestLengths | None:
    """The lengths a request's images record (``image_record``), None for a request that prunes
    nothing (no image holds a record); images that record different lengths are refused."""
    found = {
        RequestLengths(record.prompt_length, record.unpruned_length)
        for record in map(image_record, mm_features)
        if record is not None
    }
    if len(found) > 1:
        raise RuntimeError(
            f"priortr: a request's images recorded different lengths {sorted(map(astuple, found))}"
        )
    return found.pop() if found else None


def take_kept(kwargs: dict[str, object]) -> torch.Tensor | None:
    """Take the records off a batch of image items' encoder inputs (vLLM batches only items with the
    same fields, so a batch holds records for all its images or for none) and return the K of each
    image, a host tensor (the fields are CPU-kept), or None for a batch without records."""
    taken = {key: kwargs.pop(key) for key in RECORD_KEYS if key in kwargs}
    if taken and len(taken) < len(RECORD_KEYS):
        raise RuntimeError(f"priortr: a batch of image items holds the record fields {sorted(taken)} only")
    return taken.get(KEPT_KEY)


@dataclass(frozen=True)
class SlotRecord:
    """What each of an image's K slots carries in its three M-RoPE channels: the request's
    ``prompt_length`` (``ImageRecord.prompt_length``) and the image's ``grid`` of N = height * width
    tokens (rows, columns)."""

    prompt_length: int
    grid: tuple[int, int]

    def encode(self, dtype: torch.dtype) -> torch.Tensor:
        """[3] values, one per M-RoPE channel, to write into every one of the image's K slots."""
        return torch.tensor([self.prompt_length, *self.grid], dtype=dtype)

    @classmethod
    def decode(cls, positions: Sequence[Sequence[int]], row: int, kept_count: int) -> SlotRecord:
        """The record in host positions [3][T] of the K = ``kept_count`` slots from ``row``; refused unless
        every slot holds the same positive values (an image whose slots hold positions instead: the
        request's positions were not given by ``positions.request_positions``)."""
        held = {tuple(channel[r] for channel in positions) for r in range(row, row + kept_count)}
        if len(held) != 1 or min(next(iter(held))) < 1:
            raise RuntimeError(
                f"priortr: a pruned image's {kept_count} slots from row {row} hold {sorted(held)}, not the "
                "one (prompt length, grid height, grid width) its positions were given; is another plug-in "
                "changing the request's positions?"
            )
        ((length, height, width),) = held
        return cls(length, (height, width))


def embedded_tokens(span: PlaceholderRange) -> tuple[int, int]:
    """(prompt index of the first token of ``span`` that takes the image's embeddings, how many do).

    vLLM's placeholder range of an image may hold tokens that stay text, its ``is_embed`` mask marking
    the ones that take embeddings: InternVL's ``<img>`` and ``</img>`` around the ``<IMG_CONTEXT>`` run,
    Mistral 3's ``[IMG_BREAK]`` after each row of ``[IMG]`` and ``[IMG_END]`` last. Those text tokens are
    never pruned, as the family's Hugging Face adapter decides. A range without a mask is all embedded."""
    if span.is_embed is None:
        return span.offset, span.length
    flags = span.is_embed.tolist()
    if not any(flags):
        raise ValueError("priortr: vLLM laid out an image whose placeholders take no embeddings")
    return span.offset + flags.index(True), sum(flags)


def shrink_prompt(prompt: list[int], ranges: list[PlaceholderRange], counts: list[int]) -> tuple:
    """``prompt`` with image ``i``'s placeholder range laid out for ``counts[i]`` kept tokens, and the
    images' new ranges (``ranges`` and ``counts`` in the same order; the ranges do not overlap).

    A shrunk range holds its text tokens before its first embedded one, then ``counts[i]`` embedded
    slots in one run, then the range's other text tokens in their order (Mistral 3's row breaks, then
    its end marker), its ``is_embed`` mask alike: every text token stays, and the slots are where the
    model writes the tokens that survive layer L, which are the image's kept tokens and its row breaks
    in prompt order at their original positions (``step.py``). A range whose embedded tokens are
    one run (every other family) is that run cut to its first ``counts[i]`` tokens."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i].offset)
    out: list[int] = []
    new: list[PlaceholderRange | None] = [None] * len(ranges)
    cursor = 0
    for i in order:
        span, kept_count = ranges[i], counts[i]
        first, _ = embedded_tokens(span)
        inside = first - span.offset
        tokens = prompt[span.offset : span.offset + span.length]
        flags = [True] * span.length if span.is_embed is None else span.is_embed.tolist()
        after = [
            token for token, embedded in zip(tokens[inside:], flags[inside:], strict=True) if not embedded
        ]
        short = [*tokens[:inside], *[prompt[first]] * kept_count, *after]
        is_embed = None
        if span.is_embed is not None:
            is_embed = torch.tensor([False] * inside + [True] * kept_count + [False] * len(after))
        out += prompt[cursor : span.offset]
        new[i] = PlaceholderRange(offset=len(out), length=len(short), is_embed=is_embed)
        out += short
        cursor = span.offset + span.length
    out += prompt[cursor:]
    return out, new


def break_rows(first_slot: int, kept_count: int, breaks: int) -> range:
    """The rows, in a short prompt, of the ``breaks`` text tokens inside an image's layout whose K =
    ``kept_count`` slots start at ``first_slot``: right after the slots, as ``shrink_prompt`` lays them."""
    return range(first_slot + kept_count, first_slot + kept_count + breaks)
