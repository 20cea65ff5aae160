"""``priortr demo``: the trained testbed on one held-out scene, unpruned, under FastV and under PriorTR.

Offline by construction: the scene is rendered by the seeded generator, the model is assembled from
installed packages (``assemble.checkpoint``). The question asks about a small object while large striped
shapes dominate the image, the setting where raw attention and prior-corrected attention can disagree
(paper, section 4); the PNG shows Q, P, S and the kept tokens of both methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from priortr import viz
from priortr.adapters import adapter_for
from priortr.api import apply
from priortr.testbed import assemble
from priortr.testbed.data import Sample, scene_samples
from priortr.testbed.evaluate import answer, is_correct

DEMO_SCENE = ("test", 7)
# The letter: the question kind the shipped model answers reliably (100/100, docs/accuracy.md).
DEMO_KIND = "letter"


@dataclass(frozen=True)
class DemoReply:
    method: str
    budget: int | None
    reply: str
    kept: int
    visual: int
    correct: bool


def load(dtype: torch.dtype = torch.float32):
    """The assembled testbed (model, processor), building it on first use."""
    directory = assemble.checkpoint()
    model = LlavaForConditionalGeneration.from_pretrained(directory, dtype=dtype).eval()
    return model, AutoProcessor.from_pretrained(directory)


def demo_sample() -> Sample:
    split, index = DEMO_SCENE
    return next(s for s in scene_samples(split, index) if s.kind == DEMO_KIND)


def run(model, processor, sample: Sample, image, budget: int, layer: int, methods=("fastv", "priortr")):
    """The replies of the stock model and of each method at ``budget``."""
    replies = []
    with torch.inference_mode():
        reply = answer(model, processor, [(sample, image)], max_new_tokens=8)[0]
        visual = int(model.config.image_seq_length)
        replies.append(DemoReply("vanilla", None, reply, visual, visual, is_correct(sample, reply)))
        for method in methods:
            with apply(model, method=method, budget=budget, layer=layer, strict=True) as handle:
                reply = answer(model, processor, [(sample, image)], max_new_tokens=8)[0]
                kept = int((handle.last.kept[0] >= 0).sum())
            replies.append(DemoReply(method, budget, reply, kept, visual, is_correct(sample, reply)))
    return replies


def figure(
    model, processor, sample: Sample, image, budget: int, layer: int, path: Path, methods=("fastv", "priortr")
) -> Path:
    maps = []
    for method in methods:
        maps += viz.attention_maps(
            model, processor, image, sample.question, layers=(layer,), budgets=(budget,), method=method
        )
    view = adapter_for(model).image_view(image, processor)
    title = f'testbed, "{sample.question}" (answer: {sample.answer}); rows: {", ".join(methods)}'
    return viz.render(maps, view, path, title=title)
