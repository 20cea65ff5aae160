"""Loading the plug-in is safe and fails closed: on an unsupported vLLM, or on any error while
registering, it logs one warning and installs only a guard, under which an engine whose model config
carries priortr settings refuses to start (naming priortr and the supported range) while a stock model
starts; a model config without priortr settings gets vLLM's own class."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import vllm
from packaging.requirements import Requirement
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.config import MODELS_CONFIG_MAP
from vllm.model_executor.models.llava import LlavaForConditionalGeneration
from vllm.plugins import load_general_plugins

import priortr.integrations.vllm as plugin
from priortr.integrations.vllm import architectures, registration, served_families
from tests.vllm.reference import ENGINE, LLAVA_PROMPT, hf_tokens, image


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.33.0", True),
        ("0.33.1.dev5+g0123abc", True),
        ("0.34.0", True),
        ("0.34.1rc1", True),
        ("0.31.2", False),
        ("0.35.0", False),
        ("0.35.0.dev3", False),
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


ARCHITECTURES = [family.architecture for family in served_families.FAMILIES] + list(architectures.UNSERVED)
"""Every architecture the plug-in registers a config hook for."""


@pytest.fixture
def unregistered():
    """vLLM's config hooks as they are before the plug-in registers (this process registers it with
    the first engine it builds), so that a test can load the plug-in afresh; restored after it."""
    load_general_plugins()
    saved = dict(MODELS_CONFIG_MAP)
    for architecture in ARCHITECTURES:
        own = getattr(MODELS_CONFIG_MAP.pop(architecture, None), "previous", None)
        if own is not None:
            MODELS_CONFIG_MAP[architecture] = own
    yield
    MODELS_CONFIG_MAP.clear()
    MODELS_CONFIG_MAP.update(saved)


def engine_config(model_dir, settings):
    """vLLM's engine config of ``model_dir`` with ``settings`` as its priortr settings (None: stock)."""
    overrides = {} if settings is None else {"priortr": settings}
    args = EngineArgs(
        model=str(model_dir), max_model_len=256, max_num_batched_tokens=256, hf_overrides=overrides
    )
    return args.create_engine_config()


@pytest.fixture
def registered(monkeypatch):
    """Calls of ``register_all`` made by ``register()``, recorded instead of registering."""
    calls = []
    monkeypatch.setattr(registration, "register_all", lambda: calls.append(True))
    return calls


def test_unsupported_vllm_registers_only_the_guard(unregistered, monkeypatch, caplog, registered):
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert registered == []
    assert [record.levelno for record in caplog.records] == [logging.WARNING]
    assert "found 0.99.0" in caplog.text and "refuses to start" in caplog.text


def test_supported_vllm_registers(monkeypatch, caplog, registered):
    """Positive control of the test above: the same call on a supported version registers."""
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert registered == [True]
    assert caplog.records == []


def test_unsupported_vllm_refuses_priortr_and_starts_stock(monkeypatch, llava_dir, unregistered):
    """Fail closed: on a vLLM reported as 0.99.0 a model with priortr settings does not start (it would
    be served unpruned), the error naming priortr, the version found and the supported range; the same
    checkpoint without them starts as stock vLLM."""
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    plugin.register()
    with pytest.raises(
        ValueError,
        match=r"priortr's vLLM plug-in is not active .*>=0\.32,<0\.35 and found 0\.99\.0.*unpruned",
    ):
        engine_config(llava_dir, {"method": "priortr", "budget": 4})
    stock = engine_config(llava_dir, None)
    assert stock.scheduler_config.scheduler_cls is None


def test_error_while_registering_refuses_a_priortr_model(monkeypatch, caplog, llava_dir, unregistered):
    """An error while registering (here half-way: the real registration, then an import error) is one
    warning and never raises (vLLM's plug-in loader would fail every command, --help included); an
    engine with priortr settings then refuses to start, naming the error and the supported range, and a
    stock one starts."""
    register_all = registration.register_all

    def broken() -> None:
        register_all()
        raise ImportError("cannot import name 'MULTIMODAL_REGISTRY' from 'vllm.multimodal'")

    monkeypatch.setattr(registration, "register_all", broken)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    ours = [record for record in caplog.records if record.name == plugin.__name__]
    assert [record.levelno for record in ours] == [
        logging.WARNING
    ]  # vLLM's own notes on re-registering aside
    assert "MULTIMODAL_REGISTRY" in ours[0].getMessage()
    with pytest.raises(ValueError, match=r"not active \(registering it .* ImportError: .*>=0\.32,<0\.35"):
        engine_config(llava_dir, {"method": "priortr", "budget": 4})
    engine_config(llava_dir, None)


def test_server_help_runs_on_an_unsupported_vllm():
    """vLLM loads the plug-in while it parses the server's command line: with the version reported
    as 0.99.0 the plug-in installs its guard, says so once, and --help still prints and exits 0."""
    script = (
        "import runpy, sys, vllm; vllm.__version__ = '0.99.0'; sys.argv = ['api_server', '--help']; "
        "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--hf-overrides" in done.stdout
    assert (
        "plug-in is not active (it supports vLLM >=0.32,<0.35 and found 0.99.0)" in done.stdout + done.stderr
    )


def test_registered_plug_in_starts_a_priortr_model(llava_dir, unregistered):
    """Negative control of the two tests above: registered on this supported vLLM, the same config
    starts, scheduled by the plug-in's scheduler."""
    plugin.register()
    config = engine_config(llava_dir, {"method": "priortr", "budget": 4})
    assert config.scheduler_config.scheduler_cls.startswith("priortr.")


def test_a_guard_that_cannot_install_is_an_error_in_the_log(monkeypatch, caplog, unregistered):
    """Where even the guard cannot be installed (vLLM's MODELS_CONFIG_MAP gone), the plug-in still
    never raises, and logs an error saying a priortr model would be served unpruned."""
    from priortr.integrations.vllm import guard

    def gone(reason: str) -> None:
        raise ImportError("cannot import name 'MODELS_CONFIG_MAP'")

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setattr(guard, "install", gone)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        plugin.register()
    assert [record.levelno for record in caplog.records] == [logging.ERROR]
    assert "UNPRUNED" in caplog.text


def test_guarded_architectures_are_the_registered_ones():
    """The guard's list of architectures (kept free of vLLM imports) is registration's."""
    from priortr.integrations.vllm.architectures import SERVED

    assert list(SERVED) == [family.architecture for family in served_families.FAMILIES]


def test_a_family_block_holds_one_layout():
    """Each served family's model class and processor class lay images out alike; a block whose
    processor declares another layout is refused when the row is made (negative control)."""
    for family in served_families.FAMILIES:
        assert getattr(family.processor, "layout", family.layout) == family.layout
    qwen_laid_out = {"layout": served_families.QWEN_LAYOUT}
    mismatched = type("Mismatched", (served_families.LlavaProcessor,), qwen_laid_out)
    with pytest.raises(TypeError, match="one block, one layout"):
        dataclasses.replace(served_families.LLAVA, processor=mismatched)


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
