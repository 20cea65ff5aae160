"""The trained testbed: assembled offline from installed packages into a stock LLaVA checkpoint that the
library, ``priortr demo`` and ``priortr eval`` run on unchanged.

The accuracy smoke check, with its blind control, is in ``test_accuracy.py``.
"""

import json

import pytest
import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

import priortr
from priortr import cli
from priortr.frontend.prompts import prompt_text
from priortr.testbed import assemble, data, evaluate
from priortr.testbed.architecture import GRID

pytestmark = pytest.mark.skipif(
    not assemble.WEIGHTS.is_file(), reason="the trained testbed parts are not in this checkout"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Assembled from scratch into an empty cache (the test machines cannot reach the hub at all)."""
    return assemble.checkpoint(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def testbed(checkpoint):
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(checkpoint)


def test_assembly_is_cached_and_loads_as_a_stock_llava(checkpoint, testbed):
    assert assemble.checkpoint(checkpoint.parent) == checkpoint  # second call reuses the cache
    model = testbed[0]
    assert type(model) is LlavaForConditionalGeneration
    assert model.config.text_config.num_hidden_layers == 30 and model.config.image_seq_length == GRID * GRID
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    metadata = json.loads((checkpoint / "done.json").read_text())
    assert int(metadata["lora_rank"]) > 0


def test_the_processor_expands_the_image_and_the_separator_follows_it(testbed):
    model, processor = testbed
    sample = data.load_split("scenes-test", limit=1)[0]
    inputs = processor(
        images=sample.image(), text=prompt_text(processor, sample.question), return_tensors="pt"
    )
    ids = inputs["input_ids"][0]
    image = torch.nonzero(ids == model.config.image_token_id).flatten()
    assert image.numel() == GRID * GRID and torch.equal(image, torch.arange(image[0], image[0] + GRID * GRID))
    assert processor.tokenizer.decode(ids[image[-1] + 1]) == "\n"


def test_the_language_model_is_smollm2(testbed):
    """The real pretrained LM (not random weights): it continues a plain-text prompt sensibly."""
    model, processor = testbed
    ids = processor.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in processor.tokenizer.decode(out[0, ids.shape[1] :])


def test_priortr_prunes_the_testbed_inside_generate(testbed):
    model, processor = testbed
    sample = data.load_split("scenes-test", limit=1)[0]
    with priortr.apply(model, method="priortr", budget=64, layer=2) as handle, torch.inference_mode():
        evaluate.answer(model, processor, [(sample, sample.image())])
    assert int((handle.last.kept[0] >= 0).sum()) == 64 and int(handle.last.n_visual[0]) == GRID * GRID


def test_demo_and_eval_commands(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(assemble, "cache_root", lambda: checkpoint.parent)
    assert cli.main(["demo", "--out", str(tmp_path / "demo.png")]) == 0
    out = capsys.readouterr().out
    table = out.split("maps for scene")[0]
    assert "calibrated.json" in table and "agrees" in table and (tmp_path / "demo.png").stat().st_size
    rows, notes = table.splitlines()[2:5], table.splitlines()[5:]
    assert [line.split()[0] for line in rows] == ["vanilla", "fastv", "priortr"]
    assert all(note.startswith("warning: ") and "FLOPs share" in note for note in notes)  # speed-ups in noise
    argv = [
        "eval",
        "--split",
        "scenes-test",
        "--limit",
        "4",
        "--methods",
        "vanilla",
        "priortr",
        "fastv",
        "visionzip",
        "--budgets",
        "64",
        "32",
        "--out",
        str(tmp_path / "eval"),
    ]
    assert cli.main(argv) == 0  # a pre-LLM method beside layer methods: each gets the layer it takes
    report = json.loads((tmp_path / "eval" / "scenes-test.json").read_text())
    assert [(c["method"], c["budget"]) for c in report["cells"]] == [
        ("vanilla", None),
        ("priortr", 64),
        ("priortr", 32),
        ("fastv", 64),
        ("fastv", 32),
        ("visionzip", 64),
        ("visionzip", 32),
    ]
    assert all(c["total"] == 4 for c in report["cells"])
    assert (tmp_path / "eval" / "scenes-test.png").stat().st_size and "| priortr |" in capsys.readouterr().out
