"""The transformers contract is resolved from the installed release, and anything else is refused loudly.

Runs at both ends of the supported range (``scripts/test.sh`` and ``scripts/test.sh --torch-floor``): the
names found must be the ones that release uses, a caller may pass the cache by its deprecated name, and a
model whose forwards match no known contract is refused by ``apply()`` with the release found and the
supported range, never run unpruned or left to fail at decode.
"""

from __future__ import annotations

import inspect
import re
import tomllib
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache

import priortr
from priortr import compat
from priortr.compat.calls import CACHE_NAMES
from tests.helpers.tiny import llava_batch, tiny_llava

ROOT = Path(__file__).resolve().parents[2]
RENAMED = Version("5.24.0")  # the release that renamed past_key_values -> cache


@pytest.fixture(scope="module")
def llava():
    return tiny_llava()


def release_cache_name() -> str:
    return "cache" if Version(transformers.__version__) >= RENAMED else "past_key_values"


def test_the_cache_name_is_the_installed_releases(llava):
    model_contract, layer_contract = compat.calls.resolve(llava.model, llava.model.language_model.layers)
    assert model_contract.cache == layer_contract.cache == release_cache_name()


def test_the_floor_is_declared_once():
    """pyproject's bound, the library's FLOOR and the floor lock name the same release."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bound = next(
        re.search(r">=([\d.]+)", dep).group(1) for dep in dependencies if dep.startswith("transformers")
    )
    locked = re.search(r"^transformers==(.+)$", (ROOT / "constraints/floor.txt").read_text(), re.M).group(1)
    assert Version(bound) == Version(compat.release.FLOOR) == Version(locked)


def test_the_declared_torch_range_is_the_tested_one():
    """pyproject's torch range admits the releases scripts/setup.sh tests at its ends (--torch-floor,
    --torch-newest) and, for the floor, nothing older; the oldest torch is tested with the oldest
    transformers (the floor lock's); the suite itself runs on one inside the range."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = next(dep.split("#")[0].strip() for dep in dependencies if re.match(r"torch\b", dep))
    floor, below = re.search(r">=([\d.]+),<([\d.]+)", declared).groups()
    setup = (ROOT / "scripts/setup.sh").read_text()
    floor_pins = r'torch_pins=\("torch==([\d.]+)" "\$\(grep "\^transformers==" constraints/floor\.txt\)"\)'
    tested_floor = re.search(floor_pins, setup).group(1)
    tested_newest = re.search(r'torch_pins=\("torch==([\d.]+)" "torchvision', setup).group(1)
    assert Version(tested_floor) == Version(floor)
    assert Version(tested_floor) <= Version(tested_newest) < Version(below)
    assert Version(below).release[:2] == (
        Version(tested_newest).release[0],
        Version(tested_newest).release[1] + 1,
    )
    assert Version(floor) <= Version(torch.__version__.split("+")[0]) < Version(below)


@pytest.mark.parametrize("name", CACHE_NAMES)
def test_a_cache_passed_by_either_name_is_pruned(llava, name):
    """From 5.24 the models take ``cache`` and still accept ``past_key_values``; the engine must prune the
    cache whichever name the caller used (before 5.24 only ``past_key_values`` exists)."""
    if name not in inspect.signature(llava.forward).parameters and name != "past_key_values":
        pytest.skip(f"transformers {transformers.__version__} takes no {name}=")
    batch = llava_batch(llava, batch_size=1)
    cache = DynamicCache()
    with priortr.apply(llava, budget=4, layer=1), torch.no_grad():
        llava(**batch.kwargs(), **{name: cache}, use_cache=True)
    assert cache.get_seq_length() == batch.seq_len - batch.n_visual + 4


class _Renamed(torch.nn.Module):
    """A decoder layer whose forward takes its cache by a name no release used."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.inner = layer

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, kv_store=None, **kwargs):
        return self.inner(
            hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings
        )


def test_a_layer_with_an_unknown_cache_name_is_refused_at_apply():
    model = tiny_llava()
    layers = model.model.language_model.layers
    for index, layer in enumerate(layers):
        layers[index] = _Renamed(layer)
    found, floor = re.escape(transformers.__version__), re.escape(compat.release.FLOOR)
    message = (
        rf"_Renamed takes its KV cache by none of the known names.*Found transformers {found}.*>= {floor}"
    )
    with pytest.raises(compat.UnsupportedTransformers, match=message):
        priortr.apply(model, budget=4, layer=1)


def test_a_layer_without_rope_is_refused_at_apply():
    model = tiny_llava()
    layer_type = type(model.model.language_model.layers[0])

    def forward(self, hidden_states, attention_mask=None, cache=None, **kwargs):
        raise AssertionError("never called")

    planted = type("NoRope", (layer_type,), {"forward": forward})
    for layer in model.model.language_model.layers:
        layer.__class__ = planted
    with pytest.raises(compat.UnsupportedTransformers, match="NoRope takes no position_embeddings"):
        priortr.apply(model, budget=4, layer=1)


def test_a_layer_called_without_its_cache_keyword_is_refused():
    """A text model that stopped passing the cache keyword to its layers would leave layers 0..L's cache
    unpruned; the layer view refuses the call instead of reading None."""
    contract = compat.calls.LayerContract(cache=release_cache_name())
    hidden = torch.zeros(1, 3, 4)
    with pytest.raises(compat.UnsupportedTransformers, match=f"without {release_cache_name()}"):
        contract.call((hidden,), {"position_embeddings": (hidden, hidden), "attention_mask": None})


def test_a_release_older_than_the_floor_is_refused(llava, monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.16.1")
    with pytest.raises(compat.UnsupportedTransformers, match="older than the oldest supported"):
        priortr.apply(llava, budget=4, layer=1)


def test_flex_attention_is_refused_at_apply():
    with pytest.raises(ValueError, match="attn_implementation='flex_attention'"):
        compat.masks.explicit_mask_builder("flex_attention")


def test_an_unknown_cache_layer_is_refused():
    class Unknown:
        keys = torch.zeros(1, 1, 2, 1)

    cache = type("FakeCache", (), {"layers": [Unknown()]})()
    with pytest.raises(ValueError, match="cache layer 0 is a Unknown"):
        compat.cache.check_prunable(cache, 0)
