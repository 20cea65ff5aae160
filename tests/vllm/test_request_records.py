"""What a pruned request carries across vLLM's processes (``request_records.py``) and how a family lays out an
image (``positions.FamilyLayout``), on hand-computed values: each record is read back as written, and a
record that is missing, partial or corrupted is refused, never read as a plan."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.multimodal.inputs import MultiModalKwargsItem, PlaceholderRange

from priortr.integrations.vllm.positions import (
    FamilyLayout,
    ImageSlots,
    linear_positions,
    request_positions,
)
from priortr.integrations.vllm.request_records import (
    ENCODED_KEY,
    KEPT_KEY,
    PROMPT_LENGTH_KEY,
    RECORD_KEYS,
    UNPRUNED_LENGTH_KEY,
    ImageRecord,
    RequestLengths,
    SlotRecord,
    break_rows,
    image_record,
    recorded_lengths,
    shrink_prompt,
    take_kept,
    with_record,
)
from priortr.integrations.vllm.served_families import INTERNVL_LAYOUT, MISTRAL3_LAYOUT, QWEN_LAYOUT

IMG = 9  # an image placeholder id
RECORD = ImageRecord(prompt_length=67, kept_count=4, encoded=16, unpruned_length=91)  # 67 + 16 - 4 <= 91


def image(data: dict | None, modality: str = "image") -> SimpleNamespace:
    """A stand-in of vLLM's ``MultiModalFeatureSpec``: its modality and its item's fields."""
    return SimpleNamespace(modality=modality, data=data)


def test_the_image_record_is_four_cpu_fields_read_back_as_written():
    fields = RECORD.fields()
    assert (
        list(fields) == [PROMPT_LENGTH_KEY, KEPT_KEY, ENCODED_KEY, UNPRUNED_LENGTH_KEY] == list(RECORD_KEYS)
    )
    assert [int(fields[key].data) for key in RECORD_KEYS] == [67, 4, 16, 91]
    assert all(element.field.keep_on_cpu for element in fields.values())
    item = with_record(MultiModalKwargsItem({"pixel_values": fields[KEPT_KEY]}), RECORD)
    assert sorted(item) == sorted(["pixel_values", *RECORD_KEYS])
    assert image_record(image(item)) == RECORD
    assert with_record(None, RECORD) is None  # an item vLLM's processor cache already sent


def test_items_without_a_record_read_as_none():
    assert image_record(image({"pixel_values": 0})) is None  # an unpruned request's image
    assert image_record(image(None)) is None  # the scheduler's copy of an item without data
    assert image_record(image(RECORD.fields(), modality="video")) is None


@pytest.mark.parametrize(
    ("values", "why"),
    [
        ((67, 0, 16, 91), "no slot"),
        ((67, 17, 16, 91), "more slots than embeddings"),
        ((3, 4, 16, 91), "more slots than the prompt"),
        ((67, 4, 16, 78), "unpruned shorter than prompt + N - K = 79"),
    ],
)
def test_a_corrupted_record_is_refused(values, why):
    assert ImageRecord(67, 4, 16, 79).unpruned_length == 79  # the boundary is a record
    with pytest.raises(RuntimeError, match="not one the plug-in's processor writes"):
        ImageRecord(*values)


def test_a_partial_record_is_refused():
    fields = RECORD.fields()
    del fields[ENCODED_KEY]
    with pytest.raises(RuntimeError, match="record fields"):
        image_record(image(fields))


def test_a_request_records_one_pair_of_lengths():
    other = ImageRecord(prompt_length=67, kept_count=2, encoded=8, unpruned_length=91)
    features = [image(RECORD.fields()), image({"pixel_values": 0}), image(other.fields())]
    assert recorded_lengths(features) == RequestLengths(prompt=67, unpruned=91)
    assert recorded_lengths([image({"pixel_values": 0}), image(None)]) is None
    assert recorded_lengths([]) is None
    longer = ImageRecord(prompt_length=68, kept_count=2, encoded=8, unpruned_length=91)
    with pytest.raises(RuntimeError, match=r"different lengths \[\(67, 91\), \(68, 91\)\]"):
        recorded_lengths([image(RECORD.fields()), image(longer.fields())])


def test_the_encoder_inputs_lose_the_records_and_give_k():
    batched = {
        key: torch.tensor([value, value]) for key, value in zip(RECORD_KEYS, (67, 4, 16, 91), strict=True)
    }
    kwargs = {"pixel_values": torch.zeros(2, 3), **batched}
    assert take_kept(kwargs).tolist() == [4, 4]
    assert list(kwargs) == ["pixel_values"]
    assert take_kept(kwargs) is None and list(kwargs) == ["pixel_values"]
    with pytest.raises(RuntimeError, match="record fields"):
        take_kept({"pixel_values": 0, KEPT_KEY: torch.tensor([4])})


def test_the_slot_record_round_trips_through_the_request_positions():
    """Hand-computed: ``t I I t`` of a 1 x 4 image keeping 2 (1-D RoPE) is the full prompt ``t I I I I t``
    (positions 0..5): the text keeps 0 and 5, each slot holds (prompt length 4, grid 1 x 4), and
    decoding continues at 6 = 4 + 2."""
    record = SlotRecord(prompt_length=4, grid=(1, 4))
    assert record.encode(torch.long).tolist() == [4, 1, 4]
    slots = ImageSlots(offset=1, kept_count=2, tokens=4, grid=(1, 4))
    positions, delta = request_positions([5, IMG, IMG, 6], [slots], IMG, linear_positions, 4)
    assert positions.tolist() == [[0, 4, 4, 5], [0, 1, 1, 5], [0, 4, 4, 5]]
    assert delta == 2
    assert SlotRecord.decode(positions.tolist(), row=1, kept_count=2) == record


@pytest.mark.parametrize(
    ("positions", "row", "kept"),
    [
        ([[0, 1, 2, 3]] * 3, 1, 2),  # an unpruned request's positions: no record
        ([[0, 4, 5, 5], [0, 1, 1, 5], [0, 4, 4, 5]], 1, 2),  # the slots disagree
        ([[0, 0, 0, 5], [0, 1, 1, 5], [0, 4, 4, 5]], 1, 2),  # a prompt of no tokens
        ([[0, 4, 4, 5], [0, 1, 1, 5], [0, 4, 4, 5]], 1, 0),  # no slot
    ],
)
def test_slots_without_one_record_are_refused(positions, row, kept):
    with pytest.raises(RuntimeError, match=r"\(prompt length, grid height, grid width\)"):
        SlotRecord.decode(positions, row, kept)


def test_the_text_inside_an_image_follows_its_slots():
    """Hand-computed: Mistral 3's 2 x 2 image ``I I B I I E`` from prompt index 1 keeping 1 is ``I B E``
    in the short prompt; its one row break (``FamilyLayout.breaks``) is row 2, right after the slot."""
    prompt = [5, IMG, IMG, 7, IMG, IMG, 8, 6]
    mask = torch.tensor([True, True, False, True, True, False])
    short, (span,) = shrink_prompt(prompt, [PlaceholderRange(offset=1, length=6, is_embed=mask)], [1])
    assert short == [5, IMG, 7, 8, 6] and (span.offset, span.length) == (1, 3)
    rows = break_rows(span.offset, 1, len(MISTRAL3_LAYOUT.breaks((2, 2))))
    assert list(rows) == [2] and [short[r] for r in rows] == [7]
    assert break_rows(5, 2, 3) == range(7, 10)


def test_family_layouts():
    """Hand-computed: an image of 2 x 2 tokens from position 3."""
    assert QWEN_LAYOUT.breaks((2, 2)) == INTERNVL_LAYOUT.breaks((2, 2)) == ()
    assert MISTRAL3_LAYOUT.breaks((3, 4)) == (4, 8)
    assert QWEN_LAYOUT.image_positions(3, (2, 2)).tolist() == [[3, 3, 3, 3], [3, 3, 4, 4], [3, 4, 3, 4]]
    assert INTERNVL_LAYOUT.image_positions(3, (2, 2)).tolist() == [[3, 4, 5, 6]] * 3
    assert MISTRAL3_LAYOUT.image_positions(3, (2, 2)).tolist() == [[3, 4, 5, 6, 7]] * 3  # + a break
    positions = torch.arange(6).view(3, 2)
    assert INTERNVL_LAYOUT.layer_positions(positions).tolist() == [0, 1]
    assert QWEN_LAYOUT.layer_positions(positions) is positions
    flat = torch.arange(2)
    assert INTERNVL_LAYOUT.layer_positions(flat) is flat  # 1-D positions pass as they are
    with pytest.raises(ValueError, match="1-D RoPE only"):
        FamilyLayout(linear_rope=False, row_breaks=True)
