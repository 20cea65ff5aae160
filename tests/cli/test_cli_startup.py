"""``priortr --help``, ``priortr <command> --help`` and ``priortr methods`` answer without importing torch
or transformers (counted in ``sys.modules``, not timed), and the method catalog they read is the live
registry's."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from priortr.cli import build_parser
from priortr.cli import methods as methods_command
from priortr.methods import catalog

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "priortr.methods", "priortr.api")

RUN = """
import contextlib, io, json, sys
{preamble}
from priortr.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    code = main({argv!r})
loaded = [name for name in {heavy!r} if name in sys.modules]
print(json.dumps({{"code": code, "out": out.getvalue(), "loaded": loaded}}))
"""


def fresh(script: str) -> str:
    """The output of ``script`` run by a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def run(argv: list[str], preamble: str = "") -> dict:
    """``main(argv)`` in a fresh interpreter (after ``preamble``): exit code, output, and which heavy
    modules it imported."""
    return json.loads(fresh(RUN.format(argv=argv, heavy=HEAVY, preamble=preamble)).splitlines()[-1])


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
    """Regenerate with ``python -m priortr.methods.catalog`` after changing a method's registration.
    Compared in a fresh interpreter: this one's registry may hold methods that tests register."""
    live = json.loads(
        fresh("import json; from priortr.methods import catalog; print(json.dumps(catalog.entries()))")
    )
    assert json.loads(catalog.FILE.read_text()) == live
    assert methods_command.CATALOG == catalog.FILE


@pytest.mark.parametrize("argv", [["methods"], ["methods", "--json"]])
def test_the_listing_from_the_catalog_is_the_listing_from_the_registry(argv: list[str]) -> None:
    from_catalog = run(argv)
    from_registry = run(argv, "import priortr.methods  # the live registry is listed")
    assert "priortr.methods" not in from_catalog["loaded"]
    assert from_catalog["out"] == from_registry["out"]


def test_a_reader_that_stops_early_is_not_an_error() -> None:
    """``priortr methods | head -1``: before, the command printed "priortr: error: [Errno 32] Broken
    pipe" and exited 2; now it exits quietly with the shell's code of a writer stopped by its reader."""
    command = subprocess.Popen(
        [sys.executable, "-m", "priortr.cli", "methods"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    command.stdout.close()  # the reader is gone before the command writes
    err = command.stderr.read().decode()
    assert command.wait(timeout=120) == 141
    assert err == ""
