"""Bad command-line input, by class: every command refuses it before loading a model or measuring
anything, with one line naming the value and what is allowed, exit code 2 and no traceback.

The classes: every integer option (found by walking the parser, so a new option is covered), every
``--model`` that is not a loadable supported checkpoint, every output path, every choice, conflicting
arguments, devices this machine lacks. A few cases run as a user types them (a subprocess).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from transformers import LlamaConfig

import priortr
from priortr.cli import arguments, build_parser, checks, main
from priortr.frontend import loading
from priortr.tools import bench
from tests.helpers.checkpoint import save_tiny_llava_checkpoint

PROMPT = ["--prompt", "what is in the image"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli-input")
    image = root / "image.png"
    Image.new("RGB", (40, 30), (200, 30, 30)).save(image)
    text_only = root / "text-only"
    LlamaConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2).save_pretrained(
        text_only
    )
    (root / "empty-dir").mkdir()
    (root / "notes.txt").write_text("not an image")
    return {
        "tiny": save_tiny_llava_checkpoint(root / "tiny-llava"),
        "image": image,
        "text_only": text_only,
        "empty_dir": root / "empty-dir",
        "text_file": root / "notes.txt",
    }


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input must be refused before a model is loaded or built."""

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(loading, "load", refuse)
    monkeypatch.setattr(bench, "build_model", refuse)


def refused(capsys: pytest.CaptureFixture, argv: list[str], *message: str) -> str:
    """Run ``argv``; assert exit 2, nothing on stdout, one ``error:`` line holding ``message``."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error: " in line]
    assert len(errors) == 1 and len(err.strip().splitlines()) == 1, err
    for part in message:
        assert part in errors[0], (part, errors[0])
    return errors[0]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def int_options() -> list[tuple[str, str, str]]:
    """(command, option, a value below its minimum) for every integer option of every command."""
    cases = []
    for name, parser in subcommands().items():
        for action in parser._actions:
            if action.type in (arguments.positive_int, arguments.nonnegative_int):
                low = "0" if action.type is arguments.positive_int else "-1"
                cases += [(name, action.option_strings[-1], low), (name, action.option_strings[-1], "-5")]
    return cases


def test_no_option_takes_a_bare_int() -> None:
    """Every integer option states its range (``type=int`` accepts 0 and -1 silently)."""
    for name, parser in subcommands().items():
        for action in parser._actions:
            assert action.type is not int, f"priortr {name} {action.option_strings}: use positive_int"


REQUIRED = {  # the other arguments a command needs, so that only the option under test is bad
    "generate": ["--model", "testbed", "--image", "x.png", *PROMPT],
    "viz": ["--model", "testbed", "--image", "x.png", *PROMPT, "--out", "maps.png"],
    "report": ["results"],
}


@pytest.mark.parametrize(("command", "option", "value"), int_options())
def test_every_integer_option_below_its_minimum_is_refused(capsys, command, option, value) -> None:
    refused(capsys, [command, *REQUIRED.get(command, []), option, value], option, f"got {value}")


def test_the_issue_integer_cases_are_covered() -> None:
    cases = {(c, o) for c, o, _ in int_options()}
    for case in [
        ("bench", "--batch-sizes"),
        ("bench", "--repeats"),
        ("bench", "--decode-repeats"),
        ("eval", "--batch-size"),
        ("eval", "--limit"),
        ("bench", "--layers"),
        ("generate", "--max-new-tokens"),
    ]:
        assert case in cases


@pytest.mark.parametrize("command", ["generate", "viz"])
@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("{root}/does-not-exist", "no such directory"),
        ("./does-not-exist", "no such directory"),
        ("cat.png", "no such directory"),
        ("justaname", "no such directory"),
        ("{empty_dir}", "has no config.json"),
        ("{text_file}", "is a file"),
        ("llava-1.5-7b", "shipped config of `priortr bench`"),
        ("{text_only}", "model type 'llama' is not a vision-language family"),
    ],
)
def test_a_model_that_cannot_be_a_checkpoint_is_refused_at_once(files, capsys, command, model, message):
    """Local-looking names never reach the hub client (no retries); a text-only model names the
    supported families, not transformers' list of config classes."""
    model = model.format(root=files["tiny"].parent, **{k: v for k, v in files.items()})
    argv = [command, "--model", model, "--image", str(files["image"]), *PROMPT]
    if command == "viz":
        argv += ["--out", str(files["tiny"].parent / "maps.png")]
    line = refused(capsys, argv, message)
    if "family" in line:
        assert "llava" in line and "qwen2_vl" in line and "config classes" not in line


@pytest.mark.parametrize("model", ["/does/not/exist", "{text_only}"])
def test_eval_checks_its_model_first(files, capsys, tmp_path, model):
    model = model.format(**files)
    refused(capsys, ["eval", "--model", model, "--out", str(tmp_path)], "--model")


def test_bench_refuses_an_unknown_config(capsys, tmp_path):
    refused(capsys, ["bench", "--model", "llava-7b", "--out", str(tmp_path)], "unknown config 'llava-7b'")


@pytest.mark.parametrize(
    ("image", "message"),
    [("missing.png", "No such file"), ("{text_file}", "not an image"), ("{empty_dir}", "cannot read image")],
)
def test_an_unreadable_image_is_refused(files, capsys, image, message):
    image = image.format(**files)
    argv = ["generate", "--model", str(files["tiny"]), "--image", image, *PROMPT]
    refused(capsys, argv, "cannot read image", message)


def test_an_image_too_large_for_pil_is_one_line(files, capsys, monkeypatch):
    """Before: PIL's DecompressionBombError (a 15000 x 15000 PNG of 655 KB) ended in a traceback; here PIL's
    limit is lowered so that the 40 x 30 image stands in for it."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)
    argv = ["generate", "--model", str(files["tiny"]), "--image", str(files["image"]), *PROMPT]
    refused(capsys, argv, "cannot read image", "decompression bomb", "resize it")


@pytest.mark.parametrize("command", ["generate", "viz"])
def test_a_typed_image_placeholder_is_refused_before_the_model_loads(files, capsys, tmp_path, command):
    """Before: refused by chat_inputs only after the weights had loaded (``nothing_runs`` forbids it)."""
    argv = [command, "--model", str(files["tiny"]), "--image", str(files["image"])]
    argv += [
        "--prompt",
        "<image> what is it?",
        *(["--out", str(tmp_path / "m.png")] if command == "viz" else []),
    ]
    refused(capsys, argv, "--prompt: the prompt contains '<image>'")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"image": "image.png", "prompt": "  "}, "line 1: the prompt is empty"),  # before: accepted
        ({"image": "image.png", "prompt": "<image> what?"}, "prompt 1: the prompt contains '<image>'"),
        ({"image": "notes.txt", "prompt": "what?"}, "line 1: cannot read image"),
    ],
)
def test_calibrate_checks_every_prompt_and_image_before_the_model_loads(
    files, capsys, tmp_path, line, message
):
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("image", "text_file"):
        (folder / files[name].name).write_bytes(files[name].read_bytes())
    (folder / "prompts.jsonl").write_text(json.dumps(line) + "\n")
    argv = ["calibrate", "--model", str(files["tiny"]), "--data", str(folder), "--out", str(tmp_path / "out")]
    refused(capsys, argv, message)


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        (
            b'{"image": "image.png", "prompt": "what \\ud800 is it?"}\n',
            "line 1: the prompt is not valid UTF-8",
        ),
        (b'{"image": "image.png", "prompt": "ok?"}\n{"prompt": "\xff\xfe"}\n', "line 2 is not valid UTF-8"),
    ],
    ids=["a lone surrogate", "bytes that are not UTF-8"],
)
def test_calibrate_refuses_prompts_that_are_not_utf8_before_the_model_loads(
    files, capsys, tmp_path, contents, message
):
    """Before: the weights loaded, then the tokenizer raised a TypeError (a lone surrogate), or reading
    the file raised a UnicodeDecodeError, each with a traceback."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "image.png").write_bytes(files["image"].read_bytes())
    (folder / "prompts.jsonl").write_bytes(contents)
    argv = ["calibrate", "--model", str(files["tiny"]), "--data", str(folder), "--out", str(tmp_path / "out")]
    refused(capsys, argv, message, "UTF-8")


@pytest.mark.parametrize("command", ["generate", "viz"])
def test_a_prompt_that_is_not_utf8_is_refused_before_the_model_loads(files, capsys, tmp_path, command):
    """The bytes 0xff 0xfe on the command line reach Python as lone surrogates (surrogateescape)."""
    argv = [command, "--model", str(files["tiny"]), "--image", str(files["image"])]
    argv += [
        "--prompt",
        "what \udcff\udcfe is it?",
        *(["--out", str(tmp_path / "m.png")] if command == "viz" else []),
    ]
    refused(capsys, argv, "--prompt: the prompt is not valid UTF-8 text (byte 0xff at character 5)")


def test_an_empty_prompt_is_refused(files, capsys):
    argv = ["generate", "--model", str(files["tiny"]), "--image", str(files["image"]), "--prompt", " "]
    refused(capsys, argv, "--prompt is empty")


@pytest.mark.parametrize(
    "extra",
    [
        ["--stages", "1:4", "--budget", "8"],
        ["--stages", "1:4", "--layer", "0"],
        ["--layer", "0", "--stages", "1:4"],
    ],
)
def test_stages_with_an_explicit_budget_or_layer_conflict(files, capsys, extra):
    argv = ["generate", "--model", str(files["tiny"]), "--image", str(files["image"]), *PROMPT, *extra]
    refused(capsys, argv, "--stages sets each stage's layer and budget; drop")


@pytest.mark.parametrize("stage", ["-1:128", "-3:8"])
def test_a_negative_stage_layer_names_the_stage(files, capsys, stage):
    argv = ["generate", "--model", str(files["tiny"]), "--image", str(files["image"]), *PROMPT]
    refused(capsys, [*argv, f"--stages={stage}"], stage, ">= 0")
    refused(capsys, [*argv, "--stages", "0:8", stage], stage, ">= 0")  # as typed: not "expected one argument"


def test_a_stage_layer_past_the_model_is_refused_before_loading(files, capsys):
    argv = ["generate", "--model", str(files["tiny"]), "--image", str(files["image"]), *PROMPT]
    refused(
        capsys, [*argv, "--stages", "0:8", "9:4"], "stage layers must be strictly increasing ints in [0, 2]"
    )


def test_viz_refuses_a_method_without_maps(files, capsys, tmp_path):
    argv = ["viz", "--model", str(files["tiny"]), "--image", str(files["image"]), *PROMPT]
    line = refused(capsys, [*argv, "--method", "visionzip", "--out", str(tmp_path / "m.png")], "visionzip")
    assert "leave layer=None" not in line and "priortr" in line


@pytest.mark.parametrize(
    ("command", "extra", "message"),
    [
        ("eval", ["--methods", "vanilla", "priortr", "fastvv"], "unknown method 'fastvv'"),
        ("eval", ["--budgets", "64", "64"], "--budgets lists 64 more than once"),
        ("eval", ["--methods", "priortr", "priortr"], "--methods lists priortr more than once"),
        ("eval", ["--layer", "40"], "layer must be an int in [0, 28]"),
        ("bench", ["--methods", "vanilla", "priortr", "fastvv"], "unknown method 'fastvv'"),
        ("bench", ["--layers", "4", "--layer", "3"], "layer must be an int in [0, 2]"),
        ("bench", ["--layers", "999"], "--layers 999: the model has 32"),
        ("bench", ["--option", "pivots=2", "--methods", "priortr"], "priortr has no option pivots"),
        ("bench", ["--batch-sizes", "1", "1"], "--batch-sizes lists 1 more than once"),
        ("bench", ["--device", "cuda"], "no CUDA device"),
        ("bench", ["--device", "cuda:7"], "--device cuda:7"),
        ("bench", ["--device", "tpu"], "--device"),
        ("bench", ["--device", "nonsense"], "is not a device"),
        ("bench", ["--attn", "flash_attention_2"], "CUDA only"),
        ("bench", ["--attn", "flash"], "invalid choice: 'flash'"),
        ("bench", ["--dtype", "int8"], "invalid choice: 'int8'"),
        ("eval", ["--split", "mmbench"], "invalid choice: 'mmbench'"),
        ("eval", ["--device", "cuda"], "no CUDA device"),
        ("demo", ["--budget", "999", "--layer", "40"], "layer must be an int in [0, 28]"),
        ("flops", ["--budgets", "64", "64"], "--budgets lists 64 more than once"),
    ],
)
def test_long_runs_check_every_entry_first(capsys, tmp_path, monkeypatch, command, extra, message):
    """A typo in the last entry, a bad device or a conflict costs a second, not the run."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    out = [] if command == "flops" else ["--out", str(tmp_path / ("d.png" if command == "demo" else "out"))]
    refused(capsys, [command, *extra, *out], message)


@pytest.mark.parametrize("command", ["eval", "bench", "report"])
def test_an_output_folder_that_cannot_be_written_is_refused_first(capsys, files, command):
    under_a_file = str(files["text_file"] / "out")
    argv = [command, "--out", under_a_file] + (["results"] if command == "report" else [])
    refused(capsys, argv, f"--out {under_a_file}: cannot write")
    refused(capsys, [command, "--out", str(files["text_file"]), *argv[3:]], "is a file; give a folder")


@pytest.mark.parametrize("command", ["viz", "demo"])
def test_an_output_file_that_is_a_folder_or_unwritable_is_refused(capsys, files, command):
    argv = (
        ["viz", "--model", str(files["tiny"]), "--image", str(files["image"]), *PROMPT]
        if command == "viz"
        else [command]
    )
    refused(capsys, [*argv, "--out", str(files["empty_dir"])], "is a directory; give a file path")
    refused(capsys, [*argv, "--out", str(files["text_file"] / "m.png")], "cannot write")
    refused(capsys, [*argv, "--out", str(files["empty_dir"] / "m.txt")], "unknown image suffix .txt")


def test_an_output_name_without_suffix_gets_png_and_says_so(tmp_path):
    assert checks.output_file(str(tmp_path / "maps")) == tmp_path / "maps.png"
    assert checks.output_file(str(tmp_path / "maps.pdf")) == tmp_path / "maps.pdf"


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device"):
        main(["--debug", "bench", "--device", "cuda"])


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"priortr {priortr.__version__}"


def console() -> list[str]:
    script = Path(sys.executable).with_name("priortr")
    return [str(script)] if script.exists() else [sys.executable, "-m", "priortr.cli"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--device", "cuda"], "no CUDA device"),
        (["eval", "--batch-size", "-1"], "argument --batch-size: must be an integer >= 1, got -1"),
        (["generate", "--model", "cat.png", "--image", "cat.png", "--prompt", "hi"], "cannot read image"),
        (["generate", "--model", "llava-1.5-7b", "--image", "{image}", "--prompt", "hi"], "shipped config"),
    ],
)
def test_as_a_user_types_it(files, tmp_path, argv, message):
    """Through the console script: exit 2, one line on stderr, nothing on stdout, in seconds."""
    argv = [arg.format(**files) for arg in argv]
    result = subprocess.run([*console(), *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    if "cuda" in argv and result.returncode == 0:  # pragma: no cover - a machine with CUDA
        pytest.skip("this machine has CUDA")
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[transformers]")]
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_prompt_bytes_that_are_not_utf8_as_a_user_types_them(files, tmp_path):
    argv = ["generate", "--model", str(files["tiny"]), "--image", str(files["image"])]
    argv = [arg.encode() for arg in [*console(), *argv]] + [b"--prompt", b"what \xff\xfe is it?"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[transformers]")]
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert len(lines) == 1 and "--prompt: the prompt is not valid UTF-8 text (byte 0xff" in lines[0], lines


def test_version_as_a_user_types_it():
    result = subprocess.run([*console(), "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("priortr ")
