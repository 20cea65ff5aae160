"""``priortr bench``'s statistics, schedule and record, on hand-computed values (no timing is asserted).

Quartiles come from the inclusive estimator and only from 5 runs on (the exclusive one put the
quartiles of 2 runs outside [min, max]); configurations are interleaved round by round so that each
runs in every position; a speed-up within the spread of the timings is flagged; an interrupted run
resumes from its record without measuring anything twice.
"""

from __future__ import annotations

import contextlib
import json
import statistics

import pytest
import torch

from priortr.tools import bench
from priortr.tools.journal import Journal
from tests.helpers.tiny import llava_batch, tiny_llava


def test_quartiles_of_five_runs_are_hand_computed():
    spread = bench.Spread.of([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (spread.median, spread.q25, spread.q75, spread.minimum, spread.maximum) == (
        3.0,
        2.0,
        4.0,
        1.0,
        5.0,
    )
    # sorted 1 3 5 7 10 100: positions 1.25 and 3.75 -> 3 + 0.25 * 2 and 7 + 0.75 * 3
    spread = bench.Spread.of([10.0, 1.0, 7.0, 3.0, 5.0, 100.0])
    assert (spread.q25, spread.q75) == (pytest.approx(3.5), pytest.approx(9.25))
    assert spread.width == pytest.approx(5.75)


@pytest.mark.parametrize("runs", [[1.0], [1.0, 2.0], [1.0, 2.0, 4.0], [1.0, 2.0, 3.0, 10.0]])
def test_fewer_than_five_runs_have_no_quartiles(runs):
    """Negative control: the estimator used before puts the quartiles of [1, 2] at 0.75 and 2.25."""
    assert statistics.quantiles([1.0, 2.0], n=4) == [0.75, 1.5, 2.25]
    spread = bench.Spread.of(runs)
    assert spread.q25 is None and spread.q75 is None
    assert spread.width == max(runs) - min(runs)
    assert f"{len(runs)} runs" in str(spread)


@pytest.mark.parametrize("n", range(5, 13))
def test_quartiles_lie_within_the_range(n):
    samples = [float((7 * i) % 11) ** 2 for i in range(n)]
    spread = bench.Spread.of(samples)
    assert spread.minimum <= spread.q25 <= spread.median <= spread.q75 <= spread.maximum


V, P, F = ("vanilla", None, 1), ("priortr", 64, 1), ("fastv", 64, 1)


def test_configurations_are_interleaved_round_by_round():
    steps = bench.schedule([V, P, F], repeats=3, decode_repeats=1, done=set())
    prefill = [step[1] for step in steps if step[0] == "prefill"]
    assert prefill == [V, P, F, P, F, V, F, V, P]
    for position in range(3):  # every configuration once in every position of a round
        assert {prefill[3 * r + position] for r in range(3)} == {V, P, F}
    assert [s for s in steps if s[0] == "setup"] == [("setup", V), ("setup", P), ("setup", F)]
    assert [s for s in steps if s[0] == "decode"] == [("decode", V, 0), ("decode", P, 0), ("decode", F, 0)]


def test_the_schedule_skips_what_is_recorded_and_batch_sizes_stay_apart():
    V8, P8 = ("vanilla", None, 8), ("priortr", 64, 8)
    done = {
        ("setup", V),
        ("prefill", V, 0),
        ("prefill", V, 1),
        ("decode", V, 0),
        ("setup", P),
        ("prefill", P, 0),
    }
    steps = bench.schedule([V, P, V8, P8], repeats=2, decode_repeats=1, done=done)
    assert steps[:4] == [("setup", P), ("prefill", P, 1), ("decode_warmup", P), ("decode", P, 0)]
    assert all(step[1][2] == 8 for step in steps[4:])


def case(median: float, width: float) -> bench.CaseResult:
    runs = [median - width / 2, median - width / 4, median, median + width / 4, median + width / 2]
    spread = bench.Spread.of(runs)
    return bench.CaseResult(
        method="m",
        budget=64,
        batch=1,
        lm_prefill_ms=spread,
        vision_ms=spread,
        overhead_ms=None,
        kv_cache_bytes=0,
        kv_cache_expected_bytes=0,
        decode_s=spread,
        samples_per_s=1.0,
        tokens_per_s=1.0,
        peak_memory_bytes=None,
        lm_flops=1.0,
        predicted_ms=2.0,
    )


def test_speed_up_and_its_resolution_on_injected_timings():
    base = case(10.0, 2.0)  # IQR 1.0
    base.predicted_ms = 8.0
    fast, close = case(5.0, 2.0), case(9.5, 4.0)  # IQR 1.0 and 2.0
    bench.compare(base, fast)
    bench.compare(base, close)
    assert (fast.speedup, fast.limit_speedup, fast.resolved) == (2.0, 4.0, True)
    assert close.speedup == pytest.approx(10 / 9.5) and not close.resolved  # 0.5 ms apart, spread 2 ms
    report = bench.BenchReport(
        meta={"device": "cpu", "device_type": "cpu", "dtype": "float32", "torch": "", "transformers": ""}
        | {"text_layers": 4},
        ceilings=bench.Ceilings(1.0, 1.0),
        cases=[base, fast, close],
    )
    warnings = bench.spread_warnings(report)
    assert len(warnings) == 1 and "1.05x is not resolved" in warnings[0] and "(2.00 ms)" in warnings[0]
    table = bench.format_markdown(report)
    assert "| 1.05x (!) |" in table and "| 2.00x |" in table and "\nwarning: m K=64" in table
    assert "10.00 [9.50, 10.50]" in table


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def model():
    return tiny_llava(dtype=torch.float32)


def run(model, journal=None, **extra):
    return bench.run_bench(
        model,
        ["vanilla", "priortr", "fastv"],
        [8],
        [1, 2],
        layer=1,
        text_tokens=6,
        new_tokens=2,
        warmup=1,
        repeats=3,
        decode_repeats=2,
        journal=journal,
        **extra,
    )


def counting(monkeypatch, interrupt_after: int | None = None) -> list[tuple]:
    """Record every measuring step run; raise KeyboardInterrupt after ``interrupt_after`` of them."""
    calls: list[tuple] = []
    for kind in ("_prefill", "_decode"):
        original = getattr(bench.Bench, kind)

        def step(self, case, inputs, round_, original=original, kind=kind):
            if interrupt_after is not None and len(calls) == interrupt_after:
                raise KeyboardInterrupt
            calls.append((kind, case, round_))
            return original(self, case, inputs, round_)

        monkeypatch.setattr(bench.Bench, kind, step)
    return calls


def shape(report: bench.BenchReport) -> list[tuple]:
    """Everything of a report that does not depend on the clock."""
    return [
        (c.method, c.budget, c.batch, c.kv_cache_bytes, c.lm_flops, c.lm_prefill_ms.runs, c.decode_s.runs)
        for c in report.cases
    ]


def test_an_interrupted_bench_resumes_without_measuring_anything_twice(model, tmp_path, monkeypatch):
    whole = run(model)
    settings = {"model": "tiny"}
    path = tmp_path / "bench.jsonl"
    first = counting(monkeypatch, interrupt_after=10)
    with pytest.raises(KeyboardInterrupt), Journal(path, settings, resume=False) as journal:
        run(model, journal)
    recorded = [json.loads(line) for line in path.read_text().splitlines()]
    assert len([r for r in recorded if r.get("kind") in ("prefill", "decode")]) == 10 == len(first)
    monkeypatch.undo()

    with pytest.raises(ValueError, match="pass --resume"):
        Journal(path, settings, resume=False)
    with pytest.raises(ValueError, match="other settings"):
        Journal(path, {"model": "other"}, resume=True)
    second = counting(monkeypatch)
    with Journal(path, settings, resume=True) as journal:
        resumed = run(model, journal)
    assert not set(first) & set(second)
    assert len(first) + len(second) == 2 * 3 * (3 + 2)  # batch sizes x configurations x (repeats + decodes)
    assert shape(resumed) == shape(whole)
    kept = {
        (r["kind"], tuple(r["case"]), r["round"]): r["lm_ms"] for r in recorded if r.get("kind") == "prefill"
    }
    final = [json.loads(line) for line in path.read_text().splitlines()]
    for record in final:
        key = (record.get("kind"), tuple(record.get("case", ())), record.get("round"))
        if key in kept:
            assert record["lm_ms"] == kept[key]  # a recorded measurement is reused, not re-measured
    assert sum(1 for r in final if r.get("kind") == "ceilings") == 1


def test_the_table_of_what_finished(model, monkeypatch):
    counting(monkeypatch, interrupt_after=11)
    runner = bench.Bench(model, ["vanilla", "priortr"], [8], [1], layer=1, text_tokens=6, new_tokens=2)
    runner.warmup, runner.repeats, runner.decode_repeats = 0, 5, 1
    with pytest.raises(KeyboardInterrupt):
        runner.run()
    # 10 prefills and vanilla's decode finished; priortr's decode was interrupted
    assert [(c.method, c.lm_prefill_ms.runs) for c in runner.report().cases] == [("vanilla", 5)]


def test_a_record_of_a_run_that_did_nothing_is_started_afresh(tmp_path):
    """A run that failed before its first measurement (say, loading the model) leaves only a header:
    the next run needs no --resume, and may change its settings."""
    path = tmp_path / "bench.jsonl"
    Journal(path, {"model": "a"}, resume=False).close()
    journal = Journal(path, {"model": "b"}, resume=False)
    journal.append({"kind": "ceilings"})
    journal.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"settings": {"model": "b"}},
        {"kind": "ceilings"},
    ]
    with pytest.raises(ValueError, match="pass --resume"):
        Journal(path, {"model": "b"}, resume=False)
    assert Journal(path, {"model": "b"}, resume=True).records == [{"kind": "ceilings"}]


def test_resuming_with_fewer_configurations_keeps_every_recorded_one(model, tmp_path, monkeypatch):
    """Before: a resumed run reported only the configurations and repeats given this time."""
    path = tmp_path / "bench.jsonl"
    with Journal(path, {"model": "tiny"}, resume=False) as journal:
        whole = run(model, journal)
    calls = counting(monkeypatch)
    with Journal(path, {"model": "tiny"}, resume=True) as journal:
        resumed = bench.run_bench(
            model, ["vanilla", "priortr"], [8], [1], layer=1, text_tokens=6, new_tokens=2, warmup=1,
            repeats=1, decode_repeats=1, journal=journal,
        )  # fmt: skip
    assert calls == []
    assert shape(resumed) == shape(whole)


def test_front_ends_time_their_arms_interleaved_as_bench_does(model):
    """``interleaved_lm_prefill`` (``calibrate``, ``demo``): every round over all arms, each round
    starting one later (``rotated``), the warm-up rounds untimed, a spread per arm."""
    entered: list[str] = []

    def arm(name: str):
        @contextlib.contextmanager
        def enter():
            entered.append(name)
            yield

        return enter

    inputs = llava_batch(model, batch_size=1).kwargs()
    spreads = bench.interleaved_lm_prefill(model, inputs, {n: arm(n) for n in "abc"}, warmup=1, repeats=5)
    assert entered == [*"abc", *"bca", *"cab", *"abc", *"bca", *"cab"]
    assert {name: spread.runs for name, spread in spreads.items()} == {"a": 5, "b": 5, "c": 5}
    assert all(s.q25 is not None and s.minimum <= s.median <= s.maximum for s in spreads.values())


def test_two_timings_are_resolved_only_beyond_either_spread():
    base = bench.Spread.of([100.0, 104.0, 100.0])  # range 4
    assert bench.resolved(base, bench.Spread.of([50.0, 50.0, 50.0]))
    assert not bench.resolved(base, bench.Spread.of([101.0, 103.0, 101.0]))  # 1 ms apart, spread 4
    assert not bench.resolved(base, bench.Spread.of([40.0, 140.0, 40.0]))  # 60 ms apart, spread 100
