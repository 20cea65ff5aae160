"""``priortr eval``'s scoring and report, on hand-made replies (the model-backed run is in
test_model.py)."""

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch

from priortr import cli
from priortr.frontend import loading
from priortr.testbed import evaluate
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


class FakeRun:
    """Stands in for the model in ``priortr eval``: replies that depend on the cell and the question,
    every question asked counted, KeyboardInterrupt after ``stop_after`` questions."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.asked: list[tuple] = []
        self.stop_after = stop_after
        self.handle: SimpleNamespace | None = None
        self.model = SimpleNamespace(config=SimpleNamespace(image_seq_length=576), dtype=torch.float32)

    @contextlib.contextmanager
    def apply(self, model, method, budget, layer, strict, options=None):
        assert layer is None
        self.options = options
        self.handle = SimpleNamespace(method=method, budget=budget, last=None)
        yield self.handle
        self.handle = None

    def answer(self, model, processor, pairs, max_new_tokens=4):
        if self.stop_after is not None and len(self.asked) + len(pairs) > self.stop_after:
            raise KeyboardInterrupt
        cell = ("vanilla", None) if self.handle is None else (self.handle.method, self.handle.budget)
        if self.handle is not None:
            rows = len(pairs)
            self.handle.last = SimpleNamespace(
                kept=torch.zeros(rows, cell[1]), n_visual=torch.full((rows,), 576)
            )
        replies = []
        for sample, _ in pairs:
            self.asked.append((*cell, sample.question, sample.image_id))
            right = (len(sample.question) + (cell[1] or 0)) % 3 != 0
            replies.append(sample.answer if right else "wrong")
        return replies

    def patch(self, monkeypatch) -> None:
        monkeypatch.setattr(evaluate, "apply", self.apply)
        monkeypatch.setattr(evaluate, "answer", self.answer)
        monkeypatch.setattr(loading, "load", lambda *_: (None, self.model))


EVAL = ["eval", "--limit", "7", "--methods", "vanilla", "priortr", "visionzip", "--budgets", "64", "32"]
EVAL += ["--batch-size", "2"]


def test_an_interrupted_eval_prints_what_finished_and_resumes_to_the_same_result(
    monkeypatch, tmp_path, capsys
):
    whole = FakeRun()
    whole.patch(monkeypatch)
    assert cli.main([*EVAL, "--out", str(tmp_path / "whole")]) == 0
    capsys.readouterr()

    first = FakeRun(stop_after=9)
    first.patch(monkeypatch)
    out = tmp_path / "resumed"
    assert cli.main([*EVAL, "--out", str(out)]) == 130
    printed, err = capsys.readouterr()
    assert "| vanilla (all 576) |" in printed and "rerun with --resume" in printed and "interrupted" in err
    assert len(first.asked) == 9  # 7 vanilla questions (batches 2 2 2 1), one priortr batch of 2
    assert len((out / "scenes-test.samples.jsonl").read_text().splitlines()) == 1 + 9

    assert cli.main([*EVAL, "--out", str(out)]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert cli.main([*EVAL, "--layer", "4", "--out", str(out), "--resume"]) == 2
    assert "other settings (layer: None then, 4 now)" in capsys.readouterr().err

    second = FakeRun()
    second.patch(monkeypatch)
    assert cli.main([*EVAL, "--out", str(out), "--resume"]) == 0
    assert not set(first.asked) & set(second.asked)  # nothing finished is asked again
    assert sorted(first.asked + second.asked) == sorted(whole.asked)
    a = json.loads((tmp_path / "whole" / "scenes-test.json").read_text())
    b = json.loads((out / "scenes-test.json").read_text())
    assert {**a, "seconds": 0} == {**b, "seconds": 0}
    answers = [json.loads(line) for line in (out / "scenes-test.samples.jsonl").read_text().splitlines()[1:]]
    assert len(answers) == 7 * 5 and {"question", "answer", "reply", "correct", "kept"} <= set(answers[0])


def test_a_second_eval_into_the_same_folder_is_refused_while_the_first_runs(monkeypatch, tmp_path, capsys):
    """Before: the second run truncated the first one's answers and both exited 0."""
    out = tmp_path / "shared"
    first = FakeRun()
    first.patch(monkeypatch)
    answer, codes = first.answer, []

    def answer_and_start_another(*args, **kwargs):
        if not codes:
            codes.append(cli.main([*EVAL, "--out", str(out)]))
            codes.append(cli.main([*EVAL, "--out", str(out), "--resume"]))
        return answer(*args, **kwargs)

    monkeypatch.setattr(evaluate, "answer", answer_and_start_another)
    assert cli.main([*EVAL, "--out", str(out)]) == 0
    assert codes == [2, 2]
    assert capsys.readouterr().err.count("being written by another run right now") == 2
    answers = (out / "scenes-test.samples.jsonl").read_text().splitlines()
    assert len(answers) == 1 + 7 * 5 and all(json.loads(line) for line in answers)


def test_resuming_with_fewer_budgets_keeps_every_recorded_cell_in_every_output(monkeypatch, tmp_path):
    """Before: the json, md and png were rewritten with the new budgets only."""
    out = tmp_path / "out"
    FakeRun().patch(monkeypatch)
    assert cli.main([*EVAL, "--out", str(out)]) == 0
    before = json.loads((out / "scenes-test.json").read_text())
    fewer = [*EVAL[: EVAL.index("--budgets")], "--budgets", "64", "--batch-size", "2"]
    again = FakeRun()
    again.patch(monkeypatch)
    assert cli.main([*fewer, "--methods", "priortr", "--out", str(out), "--resume"]) == 0
    assert again.asked == []  # nothing left to ask
    after = json.loads((out / "scenes-test.json").read_text())
    assert {**after, "seconds": 0} == {**before, "seconds": 0}
    assert "| visionzip | " in (out / "scenes-test.md").read_text()


def test_a_cell_with_some_questions_answered_is_marked_partial():
    cells = [Cell("vanilla", None, correct=2, total=2, visual_tokens=1152), Cell("priortr", 64, 1, 1)]
    cells[1].by_kind = {"colour": [1, 1]}
    table = Report("scenes-test", "testbed", None, "float32", cells, questions=2).to_markdown()
    assert "(2 questions)" in table
    assert "| priortr | 100.0 (100) [1/2] |" in table  # before: "| priortr | 100.0 (100) |"
    assert "| priortr [1/2] | 64 | 100.0 |" in table and "[n/N]: a partial cell" in table
    whole = Report("scenes-test", "testbed", None, "float32", cells[:1], questions=2).to_markdown()
    assert "[" not in whole  # negative control: a complete cell is not marked


def test_eval_takes_a_config_that_sets_options(monkeypatch, tmp_path):
    """Before: eval took only method, budget and layer from a config and sent the user to `generate`."""
    from priortr.api import apply_defaults
    from priortr.config_file import write_config

    setting = {"method": "priortr+merge", "budget": 64, "options": {"adaptive": True}}
    config = write_config(tmp_path / "merge.json", setting, apply_defaults())
    run = FakeRun()
    run.patch(monkeypatch)
    out = tmp_path / "out"
    assert cli.main(["eval", "--limit", "3", "--config", str(config), "--out", str(out)]) == 0
    assert run.options == {"adaptive": True}
    header = json.loads((out / "scenes-test.samples.jsonl").read_text().splitlines()[0])
    assert header["settings"]["options"] == {"adaptive": True}  # other options: another experiment
    again = ["eval", "--limit", "3", "--out", str(out), "--methods", "priortr+merge", "--resume"]
    assert cli.main(again) == 2
