"""The all-methods accuracy tables (``benchmarks/accuracy_table.py``) on hand-made answer journals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import accuracy_table
from benchmarks.accuracy_table import Row

HITS = {  # 5 questions: vanilla all right, priortr 4, fastv 1 (only question 0, which priortr misses)
    ("vanilla", None): [1, 1, 1, 1, 1],
    ("priortr", 64): [0, 1, 1, 1, 1],
    ("fastv", 64): [1, 0, 0, 0, 0],
}


def journal(folder: Path, split: str, layer: int | None, hits: dict) -> None:
    folder.mkdir(parents=True)
    lines = [{"settings": {"split": split, "limit": 5, "layer": layer}}]
    for (method, budget), cell in hits.items():
        for index, hit in enumerate(cell):
            lines.append({"method": method, "budget": budget, "index": index, "correct": bool(hit)})
    (folder / f"{split}.samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    journal(tmp_path / "s-default", "s", None, HITS)
    journal(tmp_path / "s-layer4", "s", 4, {("priortr", 64): [1, 1, 1, 1, 1]})
    return tmp_path


def test_rows_name_where_each_method_prunes(root: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(accuracy_table, "BUDGETS", (64,))
    n, vanilla, rows = accuracy_table.collect([root / "s-default", root / "s-layer4"])
    assert n == 5 and vanilla == [1] * 5
    assert {row.label: cells for row, cells in rows.items()} == {
        "priortr @ layer 2": {64: [0, 1, 1, 1, 1]},
        "fastv @ layer 1": {64: [1, 0, 0, 0, 0]},
        "priortr @ layer 4": {64: [1, 1, 1, 1, 1]},
    }


def test_cells_and_paired_tests_by_hand(root: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(accuracy_table, "BUDGETS", (64,))
    table = accuracy_table.split_tables(root, "s")
    # Wilson 95% for 4 of 5: centre (0.8 + 1.92/5) / 1.768, half-width 1.96 sqrt(0.16/5 + 0.96/25) / 1.768
    assert "| priortr @ layer 2 | 80 (38-96) |" in table
    # priortr @ 2 vs fastv: 4 questions only priortr answers, 1 only fastv: p = 2 (1 + 5) / 32 = 0.375
    assert "| fastv @ layer 1 | 4/1, p=0.375 |" in table
    # priortr @ 4 vs vanilla: no discordant question, p = 1
    assert "| vanilla | 0/0, p=1.000 |" in table


def test_the_paired_tables_test_the_method_asked_for(root: Path):
    """``against="fastv"``: fastv against PriorTR at layer 2 (1 / 4, p = 0.375), and downsample's row counts
    its pooled grid (8 x 8 of 24 x 24 for K = 64, before layer 0)."""
    journal(root / "s-downsample", "s", None, {("downsample", 64): [1, 1, 0, 0, 0]})
    journals = [root / "s-default", root / "s-downsample"]
    table = accuracy_table.tables("s", journals, [64], against="fastv")
    assert "fastv @ layer 1 against each method" in table and "priortr @ layer 2 against" not in table
    assert "| priortr @ layer 2 | 1/4, p=0.375 |" in table
    assert "| downsample @ before the LLM | 64 |" in table
    assert accuracy_table.mean_visual(Row("downsample", None), 192) == 169


def test_an_unfinished_cell_is_refused(tmp_path: Path):
    journal(tmp_path / "s-default", "s", None, {("priortr", 64): [1, 1, 1, 1, 1]})
    path = tmp_path / "s-default" / "s.samples.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))
    with pytest.raises(ValueError, match="4 of 5 answers"):
        accuracy_table.read_hits(path)


def test_visual_tokens_per_layer_by_hand():
    # layers 0..2 see all 576, layers 3..29 the 64 kept: (3 * 576 + 27 * 64) / 30
    assert accuracy_table.mean_visual(Row("priortr", 2), 64) == pytest.approx((3 * 576 + 27 * 64) / 30)
    assert accuracy_table.mean_visual(Row("fastv", 1), 64) == pytest.approx((2 * 576 + 28 * 64) / 30)
    assert accuracy_table.mean_visual(Row("divprune", None), 64) == 64
    # PyramidDrop on 30 layers: 576 up to layer 6, then 277, 133 and 64 (its stages' counts)
    assert accuracy_table.mean_visual(Row("pdrop", None), 64) == pytest.approx(
        (7 * 576 + 8 * 277 + 7 * 133 + 8 * 64) / 30
    )


def test_journals_of_a_whole_split_combine_and_refuse_what_does_not_pair(tmp_path: Path):
    """A whole split's journal (``limit`` null) counts its questions from the indices; journals combine
    into one table, and a cell in two journals or journals of other questions are refused."""
    clse, fewer = {("clse", 64): [0, 0, 1, 1, 1]}, {("clse", 64): [0, 1, 1]}
    for folder, hits in (("a", HITS), ("b", clse), ("c", fewer)):
        journal(tmp_path / folder, "s", None, hits)
        path = tmp_path / folder / "s.samples.jsonl"
        path.write_text(path.read_text().replace('"limit": 5', '"limit": null'))
    table = accuracy_table.tables("s", [tmp_path / "a", tmp_path / "b"], budgets=(64,))
    assert "### s: 5 questions" in table
    assert "| clse @ own schedule | 60 (23-88) |" in table
    # priortr (0, 1, 1, 1, 1) against clse (0, 0, 1, 1, 1): one question only priortr answers
    assert "| clse @ own schedule | 1/0, p=1.000 |" in table
    with pytest.raises(ValueError, match="in an earlier journal too"):
        accuracy_table.collect([tmp_path / "a", tmp_path / "a"])
    with pytest.raises(ValueError, match=r"answered \('s', 3\)"):
        accuracy_table.collect([tmp_path / "a", tmp_path / "c"])
