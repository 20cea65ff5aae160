"""``priortr eval``'s scoring and report, on hand-made replies (the model-backed run is in
test_testbed_model.py)."""

import json

import pytest

from priortr.testbed.data import Sample
from priortr.testbed.evaluate import Cell, Report, first_word


def sample(answer: str, kind: str = "colour") -> Sample:
    return Sample("scenes", "test/0", "q?", answer, kind)


@pytest.mark.parametrize(
    ("reply", "word"),
    [("Red", "red"), (" red.\n", "red"), ("K<|im_end|>", "k"), ("", ""), ("!? left side", "left")],
)
def test_first_word(reply, word):
    assert first_word(reply) == word


def test_a_reply_is_correct_on_its_first_word_only():
    cell = Cell("priortr", 64)
    cell.add(sample("red"), "red", kept=64, visual=576)
    cell.add(sample("blue"), "it is blue", kept=64, visual=576)
    cell.add(sample("K", "letter"), "k", kept=64, visual=576)
    assert (cell.correct, cell.total) == (2, 3)
    assert cell.by_kind == {"colour": [1, 2], "letter": [1, 1]}


def report() -> Report:
    vanilla = Cell("vanilla", None, correct=8, total=10, kept_tokens=5760, visual_tokens=5760)
    cells = [
        vanilla,
        Cell("fastv", 64, correct=4, total=10),
        Cell("fastv", 32, correct=2, total=10),
        Cell("priortr", 64, correct=6, total=10),
        Cell("priortr", 32, correct=5, total=10),
    ]
    return Report("scenes-test", "testbed", 2, "float32", cells)


def test_retention_is_accuracy_over_vanilla():
    r = report()
    assert r.retention(r.cells[3]) == pytest.approx(0.75)
    assert r.retention(r.cells[2]) == pytest.approx(0.25)


def test_markdown_and_json(tmp_path):
    r = report()
    table = r.to_markdown()
    assert "| K = 64 | K = 32 |" in table
    assert "| priortr | 60.0 (75) | 50.0 (62) |" in table
    assert "| vanilla (all 576) | 80.0 | 80.0 |" in table
    paths = r.write(tmp_path, "scenes-test")
    assert [p.name for p in paths] == ["scenes-test.json", "scenes-test.md", "scenes-test.png"]
    document = json.loads(paths[0].read_text())
    assert document["cells"][1]["retention"] == pytest.approx(0.5)
    assert paths[2].stat().st_size > 1000
