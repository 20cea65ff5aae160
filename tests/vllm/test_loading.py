"""Loading the plug-in is safe: on an unsupported vLLM, or on any error while registering, it logs
one warning and registers nothing; a model config without priortr settings gets vLLM's own class."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest
import vllm
from packaging.requirements import Requirement
from vllm import LLM, SamplingParams
from vllm.model_executor.models.llava import LlavaForConditionalGeneration

import priortr.integrations.vllm as plugin
from priortr.integrations.vllm import registration
from tests.vllm.reference import ENGINE, LLAVA_PROMPT, hf_tokens, image


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.33.0", True),
        ("0.33.1.dev5+g0123abc", True),
        ("0.31.2", False),
        ("0.34.0", False),
        ("0.99.0", False),
        ("unknown", False),
    ],
)
def test_supported_versions(version, expected):
    assert plugin.supported(version) is expected


def test_vllm_extra_is_the_supported_range():
    """pyproject's vllm extra (what pip installs, and what CI resolves) is SUPPORTED_VLLM."""
    project = tomllib.loads(Path(__file__).parents[2].joinpath("pyproject.toml").read_text())["project"]
    (extra,) = project["optional-dependencies"]["vllm"]
    assert Requirement(extra).name == "vllm"
    assert Requirement(extra).specifier == plugin.SUPPORTED_VLLM


@pytest.fixture
def registered(monkeypatch):
    """Calls of ``register_all`` made by ``register()``, recorded instead of registering."""
    calls = []
    monkeypatch.setattr(registration, "register_all", lambda: calls.append(True))
    return calls


def test_unsupported_vllm_registers_nothing(monkeypatch, caplog, registered):
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert registered == []
    assert [record.levelno for record in caplog.records] == [logging.WARNING]
    assert "found 0.99.0" in caplog.text


def test_supported_vllm_registers(monkeypatch, caplog, registered):
    """Positive control of the test above: the same call on a supported version registers."""
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert registered == [True]
    assert caplog.records == []


def test_error_while_registering_is_one_warning(monkeypatch, caplog):
    def broken() -> None:
        raise ImportError("cannot import name 'MULTIMODAL_REGISTRY' from 'vllm.multimodal'")

    monkeypatch.setattr(registration, "register_all", broken)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()  # does not raise: vLLM's plug-in loader would fail every command
    assert [record.levelno for record in caplog.records] == [logging.WARNING]
    assert "MULTIMODAL_REGISTRY" in caplog.text


def test_model_without_settings_is_vllms_own_class(llava_dir):
    """A stock LLaVA under the registered plug-in is built as vLLM's class and serves as stock vLLM
    (test_llava checks that the same checkpoint with priortr settings gets the pruning class)."""
    llm = LLM(model=str(llava_dir), **ENGINE)
    assert llm.apply_model(type) == [LlavaForConditionalGeneration]
    prompt = LLAVA_PROMPT.format("what is in the image")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": image(28, 0)}}, params, use_tqdm=False
    )
    assert list(out[0].outputs[0].token_ids) == hf_tokens(llava_dir, prompt, [image(28, 0)], None, 8)
    assert len(out[0].prompt_token_ids) == 9 + 16
    del llm
