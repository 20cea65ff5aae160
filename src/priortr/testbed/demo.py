"""``priortr demo``: the trained testbed on a fixed set of held-out scenes, unpruned, under FastV and
under PriorTR, at the setting the testbed's own calibration chose.

The setting comes from ``calibrated.json`` beside this module: ``priortr calibrate`` run on the training
scenes (never on test questions, docs/calibration.md) recommended it. Per method the demo reports how
many of ``DEMO_SIZE`` held-out questions it answers right, how often its answer agrees with the full
model's (the label-free signal calibration uses), its measured language-model prefill time (every
method timed in the same interleaved rounds, with its spread) and its FLOPs share; then it draws Q, P,
S and the kept tokens of both methods for one question (paper, section 4). Offline by construction:
the scenes are rendered by the seeded generator, the model is assembled from installed packages
(``assemble.checkpoint``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from priortr.adapters import adapter_for
from priortr.api import apply_defaults
from priortr.config_file import read_config
from priortr.frontend import loading
from priortr.testbed import assemble, scenes
from priortr.testbed.data import Sample, scene_samples
from priortr.testbed.evaluate import is_correct
from priortr.tools import families, viz
from priortr.tools.bench import Spread
from priortr.tools.calibrate import Calibrator, Prompt, Setting, Timing

CALIBRATED = Path(__file__).with_name("calibrated.json")
DEMO_SCENE = ("test", 7)
# The letter: the question kind the shipped model answers reliably (100/100, docs/accuracy.md).
DEMO_KIND = "letter"
# Held-out scenes past scenes-test's 400, so the demo never repeats a measured question.
DEMO_FIRST, DEMO_SIZE = 400, 8
METHODS = ("fastv", "priortr")


@dataclass(frozen=True)
class Row:
    """One method on the demo set; ``timing`` None for the unpruned model."""

    method: str
    correct: int
    total: int
    agreement: float
    lm_prefill: Spread
    timing: Timing | None
    flops_share: float
    mean_kept: float


def load(dtype: str = "float32") -> tuple[Any, Any]:
    """The assembled testbed (model, processor) on the CPU, building it on first use."""
    processor, model = loading.load(str(assemble.checkpoint()), dtype, "cpu")
    return model, processor


def demo_sample() -> Sample:
    split, index = DEMO_SCENE
    return next(s for s in scene_samples(split, index) if s.kind == DEMO_KIND)


def setting(
    config: str | Path | None = None, layer: int | None = None, budget: int | None = None
) -> dict[str, Any]:
    """The layer and budget to show: the calibrated config (or ``config``), then ``layer``/``budget``."""
    stored = read_config(config or CALIBRATED, apply_defaults())
    return {
        "layer": stored.get("layer") if layer is None else layer,
        "budget": stored.get("budget") if budget is None else budget,
    }


def demo_samples() -> list[Sample]:
    """``DEMO_SIZE`` held-out questions, one per scene, the question kinds in turn."""
    kinds = scenes.QUESTION_KINDS
    return [
        next(s for s in scene_samples("test", index) if s.kind == kinds[index % len(kinds)])
        for index in range(DEMO_FIRST, DEMO_FIRST + DEMO_SIZE)
    ]


def compare(
    model, processor, samples: list[Sample], budget: int, layer: int, methods=METHODS, repeats: int = 3
) -> list[Row]:
    """Vanilla and each method at ``layer``/``budget`` on ``samples`` (one batch); the LM prefill of the
    first sample, every method timed in the same ``repeats`` interleaved rounds (``Calibrator.time``)."""
    prompts = [Prompt(s.image_id, s.question, s.image) for s in samples]
    calibrator = Calibrator(
        model, processor, prompts, tokens=4, batch_size=len(prompts), warmup=1, repeats=repeats
    )
    reference = calibrator.reference()
    settings = [Setting(method, layer, budget) for method in methods]
    measured = [calibrator.measure(setting, reference) for setting in settings]
    timings = calibrator.time(settings)
    n_visual = float(model.config.image_seq_length)

    def right(replies: list[str]) -> int:
        return sum(is_correct(sample, reply) for sample, reply in zip(samples, replies, strict=True))

    unpruned = timings[settings[0].key].unpruned
    rows = [Row("vanilla", right(reference.replies), len(samples), 1.0, unpruned, None, 1.0, n_visual)]
    for setting, m in zip(settings, measured, strict=True):
        timing = timings[setting.key]
        rows.append(
            Row(
                method=m.method,
                correct=right(m.replies),
                total=len(samples),
                agreement=m.agreement,
                lm_prefill=timing.lm_prefill,
                timing=timing,
                flops_share=m.flops_share,
                mean_kept=m.mean_kept,
            )
        )
    return rows


def figure(
    model, processor, sample: Sample, image, budget: int, layer: int, path: Path, methods=("fastv", "priortr")
) -> Path:
    maps = []
    for method in methods:
        maps += viz.attention_maps(
            model, processor, image, sample.question, layers=(layer,), budgets=(budget,), method=method
        )
    view = families.image_view(adapter_for(model), image, processor)
    title = f'testbed, "{sample.question}" (answer: {sample.answer}); rows: {", ".join(methods)}'
    return viz.render(maps, view, path, title=title)
