"""``priortr.frontend.loading``: the one way every front end loads a model, and its errors; the one budget
parser."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from priortr.config_file import parse_budget
from priortr.frontend import loading
from priortr.frontend.prompts import prompt_text
from tests.helpers.checkpoint import save_tiny_llava_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loading")
    text_only = root / "text-only"
    LlamaConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2).save_pretrained(
        text_only
    )
    return {"tiny": save_tiny_llava_checkpoint(root / "tiny-llava"), "text_only": text_only}


def test_load_gives_the_processor_and_the_model_as_asked(checkpoints) -> None:
    processor, model = loading.load(str(checkpoints["tiny"]), "float64", "cpu", attn_implementation="eager")
    assert model.dtype == torch.float64 and model.device.type == "cpu" and not model.training
    assert model.config._attn_implementation == "eager"
    text = prompt_text(processor, "what is it")
    assert processor.image_token in text and text.rstrip().endswith("ASSISTANT:")


@pytest.mark.parametrize(
    ("source", "keywords", "message"),
    [
        ("/does/not/exist", {}, "pretrained /does/not/exist: no such directory; pass a checkpoint directory"),
        ("{text_only}", {}, "model type 'llama' is not a vision-language family"),
        ("{text_only}", {}, "it has no vision tower (a text-only model)"),
        ("{tiny}/config.json", {}, "is a file; pass the checkpoint directory"),
        ("llava-1.5-7b", {}, "is a shipped config of `priortr bench`/`flops`"),
        ("{tiny}", {"device": "cuda"}, "device cuda: this machine has no CUDA device"),
        ("{tiny}", {"device": "tpu"}, "is not a device"),
        ("{tiny}", {"dtype": "float8"}, "dtype 'float8': use auto or one of float32, float16, bfloat16"),
    ],
)
def test_load_refuses_with_one_line_before_reading_weights(
    checkpoints, monkeypatch, source, keywords, message
):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError) as error:
        loading.load(source.format(**checkpoints), option="pretrained", **keywords)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_dtype_the_device_cannot_run_is_refused() -> None:
    with pytest.raises(ValueError, match="float64 does not run on MPS"):
        loading.check_dtype("float64", torch.device("mps"))
    loading.check_dtype("float16", torch.device("cpu"))
    loading.check_dtype(None, torch.device("cpu"))
    assert loading.torch_dtype("bfloat16") is torch.bfloat16 and loading.torch_dtype(None) == "auto"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("64", 64), (" +8 ", 8), ("0.25", 0.25), ("1e-1", 0.1), (32, 32), (0.5, 0.5), (None, None)],
)
def test_one_budget_parser_for_the_cli_and_the_plug_in(value, expected) -> None:
    parsed = parse_budget(value)
    assert parsed == expected and type(parsed) is type(expected)


def test_a_budget_that_is_no_number_is_refused() -> None:
    with pytest.raises(ValueError, match="not a number: 'half'"):
        parse_budget("half")
