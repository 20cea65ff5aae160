"""``priortr families``: every image-text class of the installed transformers classified from the adapter
registry; a family a new release adds shows as ``not yet``, one whose adapter is registered as supported,
with no edit to the listing."""

from __future__ import annotations

import json

import pytest
from transformers.models.auto import modeling_auto

from priortr import adapters, compat
from priortr.adapters import FamilyAdapter, adapter_for_type, register_adapter, register_refusal
from priortr.cli import main
from priortr.tools import family_support

MAPPING = "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"


def _listing(capsys) -> dict:
    assert main(["families", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_image_text_class_is_listed_and_each_supported_one_has_its_adapter(capsys):
    listing = _listing(capsys)
    rows = {row["model_type"]: row for row in listing["families"]}
    assert set(rows) >= set(getattr(modeling_auto, MAPPING))  # transformers' own mapping, every class
    assert set(rows) == set(compat.model_classes.image_text_classes())
    assert {row["status"] for row in rows.values()} <= set(family_support.STATUSES)
    for model_type, row in rows.items():
        if row["status"] == "supported":
            assert adapter_for_type(model_type).name == row["adapter"]
        else:  # apply refuses what the listing does not mark supported
            assert row["adapter"] is None
            with pytest.raises(ValueError, match="priortr does not support"):
                adapter_for_type(model_type)
    assert (rows["llava"]["status"], rows["llava"]["adapter"]) == ("supported", "llava")
    assert rows["qwen2_5_vl"]["adapter"] == "qwen2-vl"
    assert rows["llava"]["model_class"] == "LlavaForConditionalGeneration"
    shipped = set(compat.model_classes.image_text_classes())
    assert listing["absent"] == sorted(set(adapters.supported_model_types()) - shipped)
    assert listing["transformers"] == compat.release.installed()


def test_a_family_a_new_release_adds_is_not_yet_and_its_adapter_makes_it_supported(monkeypatch, capsys):
    """A stand-in for a new release's class: listed, as ``not yet``; registering an adapter (as a new
    adapter module does) makes it supported, with nothing else changed."""
    monkeypatch.setitem(getattr(modeling_auto, MAPPING), "future_vlm", "FutureVlmForConditionalGeneration")
    row = {row["model_type"]: row for row in _listing(capsys)["families"]}["future_vlm"]
    assert (row["status"], row["model_class"], row["note"]) == (
        "not yet",
        "FutureVlmForConditionalGeneration",
        "",
    )
    assert main(["families"]) == 0
    table = capsys.readouterr().out
    assert any(
        line.split()[:3] == ["future_vlm", "FutureVlmForConditionalGeneration", "not"]
        for line in table.splitlines()
    )

    class FutureAdapter(FamilyAdapter):
        name = "future"
        model_types = ("future_vlm",)

    monkeypatch.setattr(adapters, "_ADAPTERS", dict(adapters._ADAPTERS))
    register_adapter(FutureAdapter())
    row = {row["model_type"]: row for row in _listing(capsys)["families"]}["future_vlm"]
    assert (row["status"], row["adapter"]) == ("supported", "future")


def test_a_refused_family_is_listed_with_its_reason_and_apply_gives_it(monkeypatch, capsys):
    monkeypatch.setitem(getattr(modeling_auto, MAPPING), "future_vlm", "FutureVlmForConditionalGeneration")
    monkeypatch.setattr(adapters, "_REFUSED", {})
    register_refusal("future_vlm", "its image tokens are written into the cache twice")
    row = {row["model_type"]: row for row in _listing(capsys)["families"]}["future_vlm"]
    assert (row["status"], row["note"]) == ("refused", "its image tokens are written into the cache twice")
    with pytest.raises(ValueError, match="written into the cache twice"):
        adapter_for_type("future_vlm")
    with pytest.raises(ValueError, match="already has an adapter or a refusal"):
        register_refusal("llava", "no")


def test_a_variant_on_a_supported_class_says_whose_class_it_is(monkeypatch, capsys):
    monkeypatch.setitem(getattr(modeling_auto, MAPPING), "llava_variant", "LlavaForConditionalGeneration")
    row = {row["model_type"]: row for row in _listing(capsys)["families"]}["llava_variant"]
    assert row["status"] == "not yet" and "'llava'" in row["note"]


def test_an_adapter_for_a_family_the_release_lacks_is_listed_apart(monkeypatch, capsys):
    """As an adapter for a family newer than the floor release is, on the floor run."""

    class NewerAdapter(FamilyAdapter):
        name = "newer"
        model_types = ("not_in_this_release",)

    monkeypatch.setattr(adapters, "_ADAPTERS", dict(adapters._ADAPTERS))
    register_adapter(NewerAdapter())
    listing = _listing(capsys)
    assert "not_in_this_release" in listing["absent"]
    assert "not_in_this_release" not in {row["model_type"] for row in listing["families"]}
    assert main(["families"]) == 0
    (absent,) = [line for line in capsys.readouterr().out.splitlines() if "does not ship:" in line]
    assert "not_in_this_release" in [
        name.strip() for name in absent.partition("does not ship:")[2].split(",")
    ]


def test_a_release_without_the_mappings_is_refused(monkeypatch):
    for name in compat.model_classes.MAPPINGS:
        monkeypatch.delattr(modeling_auto, name, raising=False)
    with pytest.raises(compat.UnsupportedTransformers, match="image-text mappings"):
        compat.model_classes.image_text_classes()
