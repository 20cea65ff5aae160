"""``priortr calibrate`` and config files, on a tiny random LLaVA checkpoint (no network).

The fixed points: a budget that keeps every visual token leaves the model bit-identical, so its
agreement is exactly 1, its KL exactly 0 and its FLOPs share 1; a KL is checked against one computed by
hand from two plain ``generate`` calls; a config file gives the same ``PruningConfig`` through
``apply``, the CLI and the lmms-eval plug-in as the keywords it holds.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

import priortr
from priortr.api import apply_defaults
from priortr.cli import main
from priortr.config_file import read_config, write_config
from priortr.frontend.prompts import prompt_text
from priortr.tools import calibrate, calibration_report
from priortr.tools.flops import scheduled_prefill_flops
from tests.helpers.tiny import LLAVA_N_VISUAL

PROMPTS = ["what is in the image", "describe this picture", "what color is the cat", "is the cat red"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four prompts on three images of different sizes (one image asked twice)."""
    root = tmp_path_factory.mktemp("data")
    generator = torch.Generator().manual_seed(0)
    for i, size in enumerate([(40, 30), (28, 28), (50, 64)]):
        pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(root / f"img{i}.png")
    lines = [{"image": f"img{min(i, 2)}.png", "prompt": text} for i, text in enumerate(PROMPTS)]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return root


@pytest.fixture(scope="module")
def loaded(checkpoint: Path):
    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float64).eval()
    return model, processor


def run_calibration(loaded, folder: Path, out: Path, settings, **kwargs) -> calibrate.Calibration:
    model, processor = loaded
    return calibrate.calibrate(
        model,
        processor,
        calibrate.load_prompts(str(folder)),
        settings,
        out,
        model_name="tiny",
        data_name=str(folder),
        **{"batch_size": 3, "warmup": 0, "repeats": 1, "progress": False, **kwargs},  # batches: 3 and 1
    )


def test_every_token_kept_is_exact_agreement_and_zero_kl(loaded, folder: Path, tmp_path: Path) -> None:
    settings = calibrate.grid(["fastv", "priortr"], [1], [LLAVA_N_VISUAL, 2])
    result = run_calibration(loaded, folder, tmp_path, settings)
    by_key = {m.setting.key: m for m in result.measurements}
    for method in ("fastv", "priortr"):
        full = by_key[f"{method}/L1/K{LLAVA_N_VISUAL}"]
        assert full.agreement == 1.0 and full.kl == 0.0 and full.flops_share == 1.0
        assert full.replies == result.reference.replies
        assert full.mean_kept == LLAVA_N_VISUAL
        tight = by_key[f"{method}/L1/K2"]
        assert tight.mean_kept == 2
        assert tight.kl > 0  # negative control: two of 16 tokens change the distribution
    # the full-budget configurations reach any target; the recommendation is the fastest passing one
    for method, chosen in result.recommendations().items():
        passing = [m for m in result.measurements if m.method == method and m.agreement >= result.target]
        assert chosen is not None and chosen.speedup == max(m.speedup for m in passing)
    by_flops = replace(result, rank_by="flops").recommendations()
    for method, chosen in by_flops.items():
        passing = [m for m in result.measurements if m.method == method and m.agreement >= result.target]
        assert chosen.flops_share == min(m.flops_share for m in passing)


def test_kl_and_flops_match_a_hand_computation(loaded, folder: Path, tmp_path: Path) -> None:
    model, processor = loaded
    setting = calibrate.Setting("priortr", 1, 3)
    result = run_calibration(loaded, folder, tmp_path, [setting])
    measured = result.measurements[0]
    image = Image.open(folder / "img0.png").convert("RGB")
    inputs = processor(images=[image], text=[prompt_text(processor, PROMPTS[0])], return_tensors="pt")
    inputs = inputs.to(dtype=model.dtype)

    def first_token_logprobs() -> torch.Tensor:
        out = model.generate(
            **inputs, max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        return torch.log_softmax(out.logits[0][0].float(), -1)

    with torch.inference_mode():
        full = first_token_logprobs()
        with priortr.apply(model, method="priortr", budget=3, layer=1):
            pruned = first_token_logprobs()
    expected = float((full.exp() * (full - pruned)).sum())
    # batch of 3 with left padding vs batch of 1: the same up to float64 rounding
    assert measured.kl_each[0] == pytest.approx(expected, rel=1e-6, abs=1e-12)
    text_tokens = int(inputs["attention_mask"].sum()) - LLAVA_N_VISUAL
    share = scheduled_prefill_flops(
        model.config, text_tokens, LLAVA_N_VISUAL, [(1, 3)]
    ) / scheduled_prefill_flops(model.config, text_tokens, LLAVA_N_VISUAL, [])
    assert 0 < share < 1
    # every prompt has 16 visual tokens; shares differ by text length only, so the pooled one is close
    assert measured.flops_share == pytest.approx(share, rel=0.1)


def test_clse_is_calibrated_on_its_schedule(loaded, folder: Path, tmp_path: Path) -> None:
    """A three-stage method takes no layer; its FLOPs follow its stages (16 tokens at 8: 13, 8, 2)."""
    setting = calibrate.Setting("clse", None, 8)
    assert calibrate.grid(["clse"], [1, 2], [8]) == [setting]
    measured = run_calibration(loaded, folder, tmp_path, [setting]).measurements[0]
    assert measured.mean_kept == 2
    assert 0 < measured.flops_share < 1
    # a ratio whose first stage would keep every token: CLSE runs no stage, and costs vanilla's FLOPs
    unpruned = run_calibration(loaded, folder, tmp_path, [calibrate.Setting("clse", None, 0.9)]).measurements
    assert (unpruned[0].mean_kept, unpruned[0].flops_share) == (LLAVA_N_VISUAL, 1.0)


def test_flops_count_the_tokens_a_method_leaves(loaded, folder: Path, tmp_path: Path) -> None:
    """VisionZip leaves K - 1 (its [CLS] takes a slot): its FLOPs are DivPrune's at K - 1, both cut before
    the language model, on the same prompts; not DivPrune's at K. Downsample at K = 6 pools the 4 x 4 grid
    to 2 x 2: DivPrune's FLOPs at 4."""
    settings = [calibrate.Setting("visionzip", None, 4), *calibrate.grid(["divprune"], [1], [3, 4])]
    settings.append(calibrate.Setting("downsample", None, 6))
    measured = run_calibration(loaded, folder, tmp_path, settings).measurements
    visionzip, divprune_3, divprune_4, downsample = measured
    assert visionzip.mean_kept == divprune_3.mean_kept == 3
    assert visionzip.flops_share == divprune_3.flops_share < divprune_4.flops_share
    assert downsample.mean_kept == divprune_4.mean_kept == 4
    assert downsample.flops_share == divprune_4.flops_share


def test_a_rerun_measures_only_new_configurations(loaded, folder: Path, tmp_path: Path, monkeypatch) -> None:
    first = calibrate.grid(["fastv"], [1], [8])
    run_calibration(loaded, folder, tmp_path, first)
    calls = {"reference": 0, "measure": []}
    reference, measure = calibrate.Calibrator.reference, calibrate.Calibrator.measure

    def count_reference(self):
        calls["reference"] += 1
        return reference(self)

    def count_measure(self, setting, ref):
        calls["measure"].append(setting.key)
        return measure(self, setting, ref)

    monkeypatch.setattr(calibrate.Calibrator, "reference", count_reference)
    monkeypatch.setattr(calibrate.Calibrator, "measure", count_measure)
    result = run_calibration(loaded, folder, tmp_path, calibrate.grid(["fastv"], [1], [8, 4]))
    assert calls == {"reference": 0, "measure": ["fastv/L1/K4"]}
    assert [m.budget for m in result.measurements] == [8, 4]
    # other answer lengths are other measurements: nothing is reused
    run_calibration(loaded, folder, tmp_path, first, tokens=2)
    assert calls["reference"] == 1 and calls["measure"][-1] == "fastv/L1/K8"


def test_cli_writes_results_and_a_config_that_round_trips(
    checkpoint: Path, folder: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out"
    argv = ["calibrate", "--model", str(checkpoint), "--data", str(folder), "--methods", "fastv", "priortr"]
    argv += ["--layers", "1", "--budgets", str(LLAVA_N_VISUAL), "4", "--out", str(out), "--repeats", "1"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| method | layer | K |" in printed and "recommended.json" in printed
    for name in ("calibration.json", "calibration.md", "calibration.png", "recommended.json"):
        assert (out / name).is_file(), name
    document = json.loads((out / "calibration.json").read_text())
    assert len(document["measurements"]) == 4 and document["target"] == 0.95
    assert any(m["pareto"] for m in document["measurements"])
    config = out / "recommended.json"
    stored = read_config(config, apply_defaults())
    assert set(stored) == {"method", "budget", "layer"} and stored["layer"] == 1
    assert json.loads(config.read_text())["calibration"]["agreement"] >= 0.95

    # the CLI applies the file as it applies the same flags
    image = folder / "img0.png"
    base = ["generate", "--model", str(checkpoint), "--image", str(image), "--prompt", PROMPTS[0]]
    assert main([*base, "--config", str(config)]) == 0
    via_file = capsys.readouterr().out
    flags = ["--method", stored["method"], "--budget", str(stored["budget"]), "--layer", "1"]
    assert main([*base, *flags]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == via_file.splitlines()[:2]


def test_apply_reads_a_config_through_its_own_validation(loaded, tmp_path: Path) -> None:
    model, _ = loaded
    path = write_config(
        tmp_path / "c.json",
        {"method": "fastv", "budget": 4, "layer": 1},
        apply_defaults(),
        {"agreement": 1.0},
    )
    with priortr.apply(model, config=path) as handle:
        from_file = handle.config
    with priortr.apply(model, method="fastv", budget=4, layer=1) as handle:
        assert from_file.method.name == handle.config.method.name
        assert replace(from_file, method=None) == replace(handle.config, method=None)
    with priortr.apply(model, config=path, strict=True) as handle:  # keywords the file leaves unset
        assert handle.config.strict and handle.config.budget == 4
    with pytest.raises(ValueError, match="budget=8 was passed and config"):
        priortr.apply(model, budget=8, config=path)
    bad = write_config(tmp_path / "bad.json", {"method": "fastv", "budget": 4, "layer": 9}, apply_defaults())
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\]"):
        priortr.apply(model, config=bad)
    (tmp_path / "unknown.json").write_text('{"method": "fastv", "budjet": 4}')
    with pytest.raises(ValueError, match=r"unknown keys \['budjet'\]"):
        priortr.apply(model, config=tmp_path / "unknown.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        priortr.apply(model, config=tmp_path / "list.json")
    with pytest.raises(ValueError, match="cannot read config"):
        priortr.apply(model, config=tmp_path / "missing.json")


def test_plugin_reads_a_config(checkpoint: Path, tmp_path: Path) -> None:
    pytest.importorskip("lmms_eval")
    from priortr.integrations.lmms_eval.model import PriorTRLMMs

    path = write_config(tmp_path / "c.json", {"method": "fastv", "budget": 4, "layer": 1}, apply_defaults())
    lm = PriorTRLMMs(pretrained=str(checkpoint), config=str(path), device="cpu", dtype="float64")
    assert (lm.handle.config.method.name, lm.handle.config.budget, lm.handle.config.layer) == ("fastv", 4, 1)
    assert lm.budget == 4
    lm.handle.remove()
    with pytest.raises(ValueError, match="budget=8 was passed"):
        PriorTRLMMs(pretrained=str(checkpoint), config=str(path), budget="8", device="cpu")


def test_commands_with_a_grid_refuse_a_config_they_cannot_honour(
    checkpoint: Path, tmp_path: Path, capsys
) -> None:
    path = write_config(
        tmp_path / "c.json", {"method": "priortr", "budget": 4, "layer": 1, "heads": "max"}, apply_defaults()
    )
    assert main(["flops", "--model", str(checkpoint), "--config", str(path)]) == 2
    assert "also sets heads" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (None, "has no prompts.jsonl"),
        ([{"prompt": "what is in the image"}], 'has no "image": every prompt needs an image'),
        ([{"image": "nowhere.png", "prompt": "what"}], "does not exist"),
        ([{"image": "a.png"}], 'needs a "prompt" string'),
        (["{not json"], "is not valid JSON"),
        ([], "holds no prompts"),
    ],
)
def test_bad_data_folder_is_a_clear_error(tmp_path: Path, lines, message: str) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    if lines is not None:
        text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
        (tmp_path / "prompts.jsonl").write_text(text)
    with pytest.raises(ValueError, match=message):
        calibrate.load_prompts(str(tmp_path))


def test_cli_errors_exit_2_before_loading_the_model(tmp_path: Path, capsys) -> None:
    base = ["calibrate", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "out")]
    assert main([*base, "--data", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder (nor a built-in split)" in capsys.readouterr().err
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "what"}\n')
    assert main([*base, "--data", str(tmp_path)]) == 2
    assert 'has no "image"' in capsys.readouterr().err


def test_empty_grid_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="the grid is empty: give at least one value for methods"):
        calibrate.grid([], [2], [64])
    with pytest.raises(ValueError, match="for budgets"):
        calibrate.grid(["fastv"], [2], [])
    with pytest.raises(ValueError, match="unknown method"):
        calibrate.grid(["nomethod"], [2], [64])


def test_demo_compares_methods_on_held_out_scenes(loaded) -> None:
    from priortr.testbed import demo

    model, processor = loaded
    samples = demo.demo_samples()[:3]
    assert [s.image_id for s in samples] == ["test/400", "test/401", "test/402"]
    rows = demo.compare(model, processor, samples, budget=LLAVA_N_VISUAL, layer=1)
    assert [row.method for row in rows] == ["vanilla", "fastv", "priortr"]
    # every token kept: each method answers exactly as the full model does
    assert all(row.agreement == 1.0 and row.correct == rows[0].correct for row in rows)
    tight = demo.compare(model, processor, samples, budget=1, layer=1)
    assert [row.mean_kept for row in tight] == [LLAVA_N_VISUAL, 1, 1]


def test_the_shipped_testbed_setting_is_a_valid_config(loaded) -> None:
    from priortr.testbed import demo

    stored = read_config(demo.CALIBRATED, apply_defaults())
    assert demo.setting() == {"layer": stored["layer"], "budget": stored["budget"]}
    assert demo.setting(layer=2, budget=32) == {"layer": 2, "budget": 32}
    metadata = json.loads(demo.CALIBRATED.read_text())["calibration"]
    assert metadata["data"] == "scenes-train"  # chosen on training scenes, never on test questions


def test_a_config_that_sets_options_works_on_the_command_line(
    checkpoint: Path, folder: Path, tmp_path: Path, capsys
) -> None:
    """Before: the CLI passed options={} of its own, which apply() refused as a conflict with the file."""
    setting = {"method": "priortr+merge", "budget": 4, "layer": 1, "options": {"adaptive": True}}
    path = write_config(tmp_path / "merge.json", setting, apply_defaults())
    base = ["generate", "--model", str(checkpoint), "--image", str(folder / "img0.png")]
    base += ["--prompt", PROMPTS[0], "--max-new-tokens", "2"]
    assert main([*base, "--config", str(path)]) == 0
    via_file = capsys.readouterr().out
    flags = ["--method", "priortr+merge", "--budget", "4", "--layer", "1", "--option", "adaptive=true"]
    assert main([*base, *flags]) == 0  # JSON's lower-case true as well as True
    assert capsys.readouterr().out.splitlines()[:2] == via_file.splitlines()[:2]
    assert main([*base, "--config", str(path), "--option", "adaptive=False"]) == 2  # a real conflict
    assert "options={'adaptive': False} was passed and config" in capsys.readouterr().err
    assert main(["flops", "--model", str(checkpoint), "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "each method at its default options" in err and "priortr bench --config" in err
    assert "generate" not in err


@pytest.mark.parametrize(
    "setting",
    [
        {"method": "fastv", "budget": 4, "layer": 1},  # as `priortr calibrate` writes it: no options
        {"method": "priortr+merge", "budget": 4, "layer": 1, "options": {"adaptive": True}},
    ],
)
def test_bench_takes_a_config_with_or_without_options(checkpoint: Path, tmp_path: Path, setting) -> None:
    """Before: a config without options stopped bench with an AttributeError traceback."""
    path = write_config(tmp_path / "c.json", setting, apply_defaults())
    argv = ["bench", "--model", str(checkpoint), "--config", str(path), "--batch-sizes", "1", "--warmup", "0"]
    argv += ["--repeats", "1", "--decode-repeats", "1", "--new-tokens", "1", "--text-tokens", "6"]
    assert main([*argv, "--device", "cpu", "--out", str(tmp_path / "bench"), "--json"]) == 0
    cases = json.loads((tmp_path / "bench" / "bench.json").read_text())["cases"]
    assert [(c["method"], c["budget"]) for c in cases] == [("vanilla", None), (setting["method"], 4)]


def scripted_timings(monkeypatch, model, timings: dict) -> None:
    """The language-model prefill times each configuration measures, in turn: keyed by
    (method, budget) of the pruning attached to ``model`` at the time (None: the unpruned model)."""
    from priortr import api
    from priortr.frontend import timing

    served = {key: itertools.cycle(values) for key, values in timings.items()}

    def elapsed_ms(self, start: str, end: str) -> float:
        handle = api._ATTACHED.get(model)
        return next(served[None if handle is None else (handle.config.method.name, handle.config.budget)])

    monkeypatch.setattr(timing.Clock, "elapsed_ms", elapsed_ms)


def test_a_speed_up_within_noise_is_flagged_and_not_recommended(
    loaded, folder: Path, tmp_path: Path, monkeypatch
) -> None:
    """Before: a speed-up was the ratio of two medians timed minutes apart, printed bare and ranked as
    measured, so a noisy 2.5x beat a clear 1.67x."""
    model, _ = loaded
    noisy, clear = ("fastv", 8), ("fastv", LLAVA_N_VISUAL)
    timings = {None: [100.0, 104.0, 100.0], clear: [60.0], noisy: [40.0, 140.0, 40.0]}
    scripted_timings(monkeypatch, model, timings)
    settings = calibrate.grid(["fastv"], [1], [LLAVA_N_VISUAL, 8])
    result = run_calibration(loaded, folder, tmp_path, settings, target=0.01, repeats=3)
    by_budget = {m.budget: m for m in result.measurements}
    assert by_budget[8].speedup == pytest.approx(2.5) and not by_budget[8].resolved
    assert by_budget[LLAVA_N_VISUAL].speedup == pytest.approx(100 / 60) and by_budget[LLAVA_N_VISUAL].resolved
    assert result.recommendations()["fastv"].budget == LLAVA_N_VISUAL
    table = calibration_report.to_markdown(result)
    assert "| 2.50x (!) |" in table and "| 1.67x |" in table
    assert "warning: fastv L1 K=8: the LM prefill medians differ by less than the spread" in table
    assert "100.00 (range 100.00-104.00, 3 runs)" in table
    document = calibration_report.to_dict(result)["measurements"]
    assert [m["speedup_resolved"] for m in document] == [True, False]


def test_the_demo_flags_a_speed_up_within_noise(loaded, tmp_path: Path, monkeypatch, capsys) -> None:
    """Before: `priortr demo` printed "PriorTR 0.86x" beside "FastV 12.95x" from medians timed one after
    the other, with nothing to say that the first was noise."""
    from priortr.testbed import demo

    model, processor = loaded
    timings = {None: [100.0, 104.0, 100.0], ("fastv", 4): [50.0], ("priortr", 4): [101.0, 103.0, 101.0]}
    scripted_timings(monkeypatch, model, timings)
    monkeypatch.setattr(demo, "load", lambda: (model, processor))
    samples = demo.demo_samples()[:2]
    monkeypatch.setattr(demo, "demo_samples", lambda: samples)
    monkeypatch.setattr(demo, "figure", lambda *args: args[-1])
    assert main(["demo", "--layer", "1", "--budget", "4", "--out", str(tmp_path / "demo.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    fastv = next(line for line in lines if line.strip().startswith("fastv"))
    priortr_line = next(line for line in lines if line.strip().startswith("priortr"))
    assert "2.00x" in fastv and "(!)" not in fastv
    assert "0.99x (!)" in priortr_line
    assert any(line.startswith("warning: priortr: the LM prefill medians differ") for line in lines)


def test_rank_by_reaches_the_result(loaded, folder: Path, tmp_path: Path) -> None:
    """Before: calibrate() checked rank_by and then ranked by speed-up whatever was asked."""
    result = run_calibration(loaded, folder, tmp_path, calibrate.grid(["fastv"], [1], [8]), rank_by="flops")
    assert result.rank_by == "flops" and calibration_report.to_dict(result)["rank_by"] == "flops"
