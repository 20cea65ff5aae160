"""README.md, followed literally: every ``priortr`` command in a ``bash`` block parses, the cheap ones
run as written (in order, in one empty folder, as a new user would), and the Python snippet runs with
the hub checkpoint swapped for the local testbed. Lines tagged ``# slow`` or ``# GPU only`` are
parsed, not run; ``text`` blocks are synopses with optional parts and are not commands.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from priortr.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"
NOT_RUN = ("slow", "GPU only")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def commands() -> list[tuple[list[str], str]]:
    """(argv, comment) of each command line of the README's bash blocks, continuations joined."""
    found = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            code, _, comment = line.partition("#")
            if code.strip():
                found.append((shlex.split(code), comment))
    return found


def priortr_commands() -> list[tuple[list[str], str]]:
    return [(argv, comment) for argv, comment in commands() if argv[0] == "priortr"]


def test_the_readme_has_the_commands_this_test_reads():
    assert len(priortr_commands()) >= 10
    setup = [" ".join(argv) for argv, _ in commands() if argv[0] == "bash"]
    assert "bash scripts/setup.sh && .venv/bin/priortr demo" in setup
    assert "bash scripts/test.sh" in setup


@pytest.mark.parametrize(("argv", "comment"), priortr_commands(), ids=lambda v: " ".join(v)[:60] if v else "")
def test_every_command_parses(argv, comment):
    try:
        build_parser().parse_args(argv[1:])
    except SystemExit as exit_:  # --version
        assert exit_.code == 0 and argv[1:] == ["--version"]


def test_gpu_commands_are_marked():
    for argv, comment in priortr_commands():
        if "cuda" in argv:
            assert "GPU only" in comment, argv


def console() -> list[str]:
    script = Path(sys.executable).with_name("priortr")
    return [str(script)] if script.exists() else [sys.executable, "-m", "priortr.cli"]


def test_the_cheap_commands_run_as_written(tmp_path):
    run = [argv for argv, comment in priortr_commands() if not any(tag in comment for tag in NOT_RUN)]
    assert ["priortr", "demo", "--save-image", "scene.png"] in run
    assert any(argv[1] == "generate" for argv in run) and any(argv[1] == "viz" for argv in run)
    for argv in run:
        result = subprocess.run(
            [*console(), *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=900
        )
        assert result.returncode == 0, (argv, result.stderr[-2000:])
    assert (tmp_path / "scene.png").is_file() and (tmp_path / "maps.png").is_file()


def test_the_python_snippet_runs_on_the_testbed(tmp_path, monkeypatch):
    from priortr.cli import main
    from priortr.testbed.assemble import checkpoint

    (snippet,) = blocks("python")
    assert '"llava-hf/llava-1.5-7b-hf"' in snippet
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--save-image", "scene.png"]) == 0
    code = snippet.replace('"llava-hf/llava-1.5-7b-hf"', repr(str(checkpoint()))).replace(
        "max_new_tokens=64", "max_new_tokens=4"
    )
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    prompt = namespace["inputs"]["input_ids"].shape[1]
    assert prompt < namespace["out"].shape[1] <= prompt + 4
    kept_rows = namespace["handle"].last.positions.shape[1]  # the answer's rows follow the prompt's
    assert namespace["logits"].shape[1] == kept_rows + namespace["out"].shape[1] - prompt
