"""``priortr --help``, ``priortr <command> --help`` and ``priortr methods`` answer without importing torch
or transformers (counted in ``sys.modules``, not timed), and the method catalog they read is the live
registry's."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from priortr.cli import build_parser, main
from priortr.cli import methods as methods_command
from priortr.methods import catalog

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "priortr.methods", "priortr.api")

RUN = """
import contextlib, io, json, sys
from priortr.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    code = main({argv!r})
loaded = [name for name in {heavy!r} if name in sys.modules]
print(json.dumps({{"code": code, "out": out.getvalue(), "loaded": loaded}}))
"""


def run(argv: list[str]) -> dict:
    """``main(argv)`` in a fresh interpreter: exit code, output, and which heavy modules it imported."""
    script = RUN.format(argv=argv, heavy=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def command_names() -> list[str]:
    parser = build_parser()
    return list(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["methods"],
        ["methods", "--json"],
        *[[c, "--help"] for c in command_names()],
    ],
)
def test_answers_without_torch(argv: list[str]) -> None:
    result = run(argv)
    assert result["code"] == 0
    assert result["out"]
    assert result["loaded"] == []


def test_the_catalog_is_the_live_registry() -> None:
    """Regenerate with ``python -m priortr.methods.catalog`` after changing a method's registration."""
    assert json.loads(catalog.FILE.read_text()) == catalog.entries()
    assert methods_command.CATALOG == catalog.FILE


def test_the_listing_from_the_catalog_is_the_listing_from_the_registry() -> None:
    assert run(["methods", "--json"])["out"] == run_in_process(["methods", "--json"])
    assert run(["methods"])["out"] == run_in_process(["methods"])


def run_in_process(argv: list[str]) -> str:
    """``main(argv)``'s output here, where the registry is imported (so the live one is listed)."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(argv) == 0
    return out.getvalue()
