"""End-to-end tests of ``priortr generate`` on a tiny local LLaVA checkpoint (no network)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from priortr.cli import main
from tests.helpers.checkpoint import save_tiny_llava_checkpoint
from tests.helpers.tiny import LLAVA_IMAGE_ID, LLAVA_N_VISUAL

PROMPT = "what is in the image"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(checkpoint directory, PNG path), built once for the module."""
    root = tmp_path_factory.mktemp("cli")
    checkpoint = save_tiny_llava_checkpoint(root / "tiny-llava")
    image = root / "image.png"
    Image.frombytes("RGB", (40, 30), bytes(range(256)) * 14 + bytes(16)).save(image)
    return checkpoint, image


def run(files: tuple[Path, Path], capsys: pytest.CaptureFixture, *extra: str) -> tuple[int, str, str]:
    checkpoint, image = files
    argv = ["generate", "--model", str(checkpoint), "--image", str(image), "--prompt", PROMPT]
    code = main([*argv, "--max-new-tokens", "6", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_checkpoint_reloads_with_16_image_tokens_then_separator_then_text(files: tuple[Path, Path]) -> None:
    checkpoint, image = files
    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    content = [{"type": "image", "image": Image.open(image)}, {"type": "text", "text": PROMPT}]
    inputs = processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(LLAVA_IMAGE_ID)
    end = start + LLAVA_N_VISUAL
    assert ids.count(LLAVA_IMAGE_ID) == LLAVA_N_VISUAL == 16
    assert ids[start:end] == [LLAVA_IMAGE_ID] * 16
    assert ids[end] == processor.tokenizer.convert_tokens_to_ids("\n")
    assert processor.decode(ids[end + 1 :]).split() == [*PROMPT.split(), "ASSISTANT:"]
    assert tuple(inputs["pixel_values"].shape) == (1, 3, 28, 28)


@pytest.mark.parametrize("budget", ["4", "0.25"])
def test_budget_count_or_ratio_keeps_4_of_16(files, capsys, budget: str) -> None:
    code, out, err = run(files, capsys, "--budget", budget)
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 3 and lines[0].strip(), out
    assert lines[1] == "visual tokens kept: 4 / 16"
    assert re.fullmatch(r"prefill: \d+\.\d ms", lines[2])


@pytest.mark.parametrize(
    ("extra", "kept"),
    [
        (["--method", "visionzip", "--option", "contextual_ratio=0.5"], 3),  # [CLS] takes one of the 4
        (["--method", "dart", "--layer", "1", "--option", "image_pivots=2"], 4),
        (["--method", "priortr", "--stages", "0:8", "1:4"], 4),
        (["--method", "pdrop"], 4),
    ],
)
def test_any_method_with_its_options_keeps_4_of_16(files, capsys, extra: list[str], kept: int) -> None:
    budget = [] if "--stages" in extra else ["--budget", "4"]  # --stages sets the budget itself
    code, out, err = run(files, capsys, *budget, *extra)
    assert code == 0, err
    assert out.splitlines()[1] == f"visual tokens kept: {kept} / 16"


def test_no_prune_matches_a_budget_covering_every_token(files, capsys) -> None:
    code, stock, err = run(files, capsys, "--no-prune")
    assert code == 0, err
    assert "pruning off" in stock.splitlines()[1]
    code, full, err = run(files, capsys, "--budget", "16")
    assert code == 0, err
    assert full.splitlines()[1] == "visual tokens kept: 16 / 16"
    assert stock.splitlines()[0] == full.splitlines()[0] != ""


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--method", "nope"], "unknown method 'nope'; available: "),
        (["--budget", "0"], "budget must be a positive token count"),
        (["--budget", "1.5"], "float budget 1.5 is not a ratio"),
        (["--layer", "99"], "layer must be an int in [0, 2]"),
        (["--method", "visionzip", "--layer", "1"], "visionzip prunes before the language model"),
        (["--option", "pivots=2"], "priortr has no option pivots"),
        (["--stages", "1:4", "0:8"], "stage layers must be strictly increasing"),
        (["--image", "does-not-exist.png"], "cannot read image 'does-not-exist.png'"),
    ],
)
def test_bad_input_exits_2_with_a_message(files, capsys, extra: list[str], message: str) -> None:
    code, out, err = run(files, capsys, *extra)
    assert code == 2
    assert out == ""
    error = [line for line in err.splitlines() if line.startswith("priortr: error: ")]
    assert len(error) == 1 and message in error[0], err
    assert "Traceback" not in err


def test_unloadable_model_exits_2(files, capsys, tmp_path: Path) -> None:
    code = main(["generate", "--model", str(tmp_path), "--image", str(files[1]), "--prompt", PROMPT])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.startswith(f"priortr: error: --model {tmp_path}: directory has no config.json"), err


def test_unparsable_budget_is_a_usage_error(files, capsys) -> None:
    code, _, err = run(files, capsys, "--budget", "lots")
    assert code == 2
    assert "argument --budget: not a number: 'lots'" in err


def test_console_script_help() -> None:
    script = Path(sys.executable).with_name("priortr")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "priortr.cli"]
    result = subprocess.run([*command, "generate", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: priortr generate" in result.stdout
    for option in ("--model", "--image", "--prompt", "--budget", "--no-prune"):
        assert option in result.stdout
