"""Named question sets for the testbed: the synthetic scenes and easy-VQA (PyPI ``easy-vqa``, MIT).

A split is a fixed, ordered list of ``Sample`` s, so an accuracy is always over the same questions:
``scenes-test`` takes one question from each of the first 400 held-out scenes, cycling through the
question kinds (100 of each); ``easy-vqa-test`` is easy-VQA's own test set (9,673 questions over
1,000 images, never used in training). ``scenes-train`` does the same as ``scenes-test`` over the first
400 training scenes, for ``priortr calibrate``, which must never choose a setting on test questions.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

from PIL import Image

from priortr.testbed import SPLITS, scenes
from priortr.tools.calibrate import Prompt

SCENE_TEST_SIZE = 400


@dataclass(frozen=True)
class Sample:
    """One question about one image, with its one-word reference answer."""

    source: str
    image_id: str
    question: str
    answer: str
    kind: str

    def image(self) -> Image.Image:
        return load_image(self.source, self.image_id)


def load_image(source: str, image_id: str) -> Image.Image:
    if source == "scenes":
        split, index = image_id.split("/")
        return scenes.make_scene(split, int(index)).image
    if source == "easy-vqa":
        split, index = image_id.split("/")
        return _easy_vqa_image(split, int(index))
    raise ValueError(f"unknown sample source {source!r}")


def scene_samples(split: str, index: int) -> list[Sample]:
    """Every question of one scene."""
    scene = scenes.make_scene(split, index)
    return [Sample("scenes", f"{split}/{index}", q.text, q.answer, q.kind) for q in scene.questions]


def easy_vqa_kind(question: str, answer: str) -> str:
    if answer in ("yes", "no"):
        return "yes/no"
    return "shape" if answer in ("circle", "rectangle", "triangle") else "colour"


def _easy_vqa():
    try:
        import easy_vqa
    except ImportError:
        raise ImportError("easy-VQA needs the `easy-vqa` package: pip install easy-vqa") from None
    return easy_vqa


@cache
def _easy_vqa_paths(split: str) -> dict[int, str]:
    module = _easy_vqa()
    return module.get_train_image_paths() if split == "train" else module.get_test_image_paths()


def _easy_vqa_image(split: str, index: int) -> Image.Image:
    with Image.open(_easy_vqa_paths(split)[index]) as image:
        return image.convert("RGB")


def easy_vqa_samples(split: str) -> list[Sample]:
    """easy-VQA's questions of ``split`` ("train" or "test"), in the package's order."""
    module = _easy_vqa()
    questions, answers, ids = (
        module.get_train_questions() if split == "train" else module.get_test_questions()
    )
    return [
        Sample("easy-vqa", f"{split}/{i}", q, a, easy_vqa_kind(q, a))
        for q, a, i in zip(questions, answers, ids, strict=True)
    ]


def scenes_test(split: str = "test") -> list[Sample]:
    """One question of each of the first 400 scenes of ``split``, the kinds in turn."""
    out = []
    for index in range(SCENE_TEST_SIZE):
        kind = scenes.QUESTION_KINDS[index % len(scenes.QUESTION_KINDS)]
        out.append(next(s for s in scene_samples(split, index) if s.kind == kind))
    return out


def load_split(name: str, limit: int | None = None) -> list[Sample]:
    """The samples of split ``name``; ``limit`` keeps a fixed random subset of that many (the same on
    every run and machine)."""
    if name == "scenes-test":
        samples = scenes_test()
    elif name == "scenes-train":
        samples = scenes_test("train")
    elif name == "easy-vqa-test":
        samples = easy_vqa_samples("test")
    else:
        raise ValueError(f"unknown split {name!r}; choose one of {SPLITS}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if limit is not None and limit < len(samples):
        # A seeded sample, in split order: an evenly spaced one would alias with the kind cycle of
        # scenes-test (every 4th question is a colour question).
        keep = sorted(random.Random(f"{name}/{limit}").sample(range(len(samples)), limit))
        samples = [samples[i] for i in keep]
    return samples


def iter_images(samples: list[Sample]) -> Iterator[tuple[Sample, Image.Image]]:
    """Each sample with its image, rendering or reading every image once."""
    last: tuple[str, str] | None = None
    image: Image.Image | None = None
    for sample in samples:
        if (sample.source, sample.image_id) != last:
            last, image = (sample.source, sample.image_id), sample.image()
        yield sample, image


def split_prompts(name: str, limit: int | None = None) -> list[Prompt]:
    """A named split as ``priortr calibrate`` prompts; its reference answers are not read."""
    return [
        Prompt(f"{sample.image_id}#{sample.kind}", sample.question, sample.image)
        for sample in load_split(name, limit)
    ]
