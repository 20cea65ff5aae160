"""The testbed's image processor is chosen explicitly: building it (``bash scripts/setup.sh`` assembles the
testbed) and loading it back (``priortr demo``) print no transformers fallback warning, and the testbed
is built with the PIL backend whether or not torchvision is installed.

Each check runs in a fresh Python: transformers logs the fallback once per process, and other tests
may already have triggered it in this one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
FALLBACK = "requires torchvision (not installed); falling back"

BUILD_AND_LOAD = """
import sys
from transformers import AutoImageProcessor
from priortr.testbed import assemble

built = assemble.image_processor()
built.save_pretrained(sys.argv[1])
AutoImageProcessor.from_pretrained(sys.argv[1])
print(type(built).__name__)
"""


def python(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with this checkout's ``src`` first on the path."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        check=True,
    )


def test_building_and_loading_the_testbed_processor_prints_no_fallback_warning(tmp_path):
    run = python(BUILD_AND_LOAD, str(tmp_path))
    assert FALLBACK not in run.stderr, run.stderr
    assert run.stdout.split() == ["CLIPImageProcessorPil"]


def test_the_fallback_warning_is_seen_where_it_happens():
    """The control: asking transformers for ``CLIPImageProcessor`` without torchvision logs the
    warning, and the capture above sees it."""
    run = python("import transformers; transformers.CLIPImageProcessor")
    if importlib.util.find_spec("torchvision") is None:
        assert FALLBACK in run.stderr, run.stderr
    else:
        assert FALLBACK not in run.stderr, run.stderr
