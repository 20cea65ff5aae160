"""Seeded synthetic scenes whose answers live in a small region of the image.

Each scene has one or two large, bright, striped shapes (visually dominant, never the subject of a
question), two or three small solid shapes and one small letter tile. Every question names a small
object and has a one-word answer, so a pruning method that keeps the salient large shapes and drops
the small target loses the answer: the failure the paper's prior correction addresses (section 4).

A scene is a pure function of ``(split, index)`` and ``VERSION``: the same pair always renders the same
pixels and questions, on any machine, because shapes and letters are drawn from polygons and strokes
(no fonts) with a per-scene ``random.Random``.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field

from PIL import Image, ImageDraw

VERSION = 2
SIZE = 192
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 170),
    "orange": (245, 130, 20),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")
# Letters drawn as strokes in a unit box, (x0, y0, x1, y1); chosen to differ in most of their 3 x 3 patches.
LETTERS: dict[str, tuple[tuple[float, float, float, float], ...]] = {
    "A": ((0, 1, 0.5, 0), (0.5, 0, 1, 1), (0.25, 0.55, 0.75, 0.55)),
    "E": ((0, 0, 0, 1), (0, 0, 1, 0), (0, 0.5, 0.8, 0.5), (0, 1, 1, 1)),
    "H": ((0, 0, 0, 1), (1, 0, 1, 1), (0, 0.5, 1, 0.5)),
    "L": ((0, 0, 0, 1), (0, 1, 1, 1)),
    "T": ((0, 0, 1, 0), (0.5, 0, 0.5, 1)),
    "V": ((0, 0, 0.5, 1), (0.5, 1, 1, 0)),
    "X": ((0, 0, 1, 1), (1, 0, 0, 1)),
    "Z": ((0, 0, 1, 0), (1, 0, 0, 1), (0, 1, 1, 1)),
}
SPLITS = ("train", "test")
GRID_STEP = 8
TILE = 24
QUESTION_KINDS = ("colour", "shape", "side", "letter")


@dataclass(frozen=True)
class Thing:
    """One drawn object; ``box`` is (x0, y0, x1, y1) in pixels."""

    kind: str  # "shape" or "letter"
    name: str  # shape name or letter
    colour: str
    box: tuple[int, int, int, int]
    large: bool = False

    @property
    def side(self) -> str:
        return "left" if (self.box[0] + self.box[2]) / 2 < SIZE / 2 else "right"


@dataclass(frozen=True)
class Question:
    text: str
    answer: str
    kind: str
    target: Thing


@dataclass
class Scene:
    split: str
    index: int
    image: Image.Image
    things: list[Thing]
    questions: list[Question] = field(default_factory=list)


def scene_rng(split: str, index: int) -> random.Random:
    """A generator private to one scene, independent of Python's hash seed and of other scenes."""
    if split not in SPLITS:
        raise ValueError(f"unknown scene split {split!r}; choose one of {SPLITS}")
    digest = hashlib.sha256(f"priortr-scenes-v{VERSION}/{split}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def _polygon(shape: str, box: tuple[int, int, int, int]) -> list[tuple[float, float]] | None:
    x0, y0, x1, y1 = box
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if shape == "triangle":
        return [(cx, y0), (x1, y1), (x0, y1)]
    if shape == "diamond":
        return [(cx, y0), (x1, cy), (cx, y1), (x0, cy)]
    return None


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill) -> None:
    polygon = _polygon(shape, box)
    if polygon is not None:
        draw.polygon(polygon, fill=fill)
    elif shape == "circle":
        draw.ellipse(box, fill=fill)
    else:
        draw.rectangle(box, fill=fill)


def thing_mask(thing: Thing) -> Image.Image:
    """The pixels ``thing`` covers (its whole tile for a letter): where its answer can be read."""
    mask = Image.new("L", (SIZE, SIZE), 0)
    shape = thing.name if thing.kind == "shape" else "square"
    _draw_shape(ImageDraw.Draw(mask), shape, thing.box, 255)
    return mask


def _stripe_mask(shape: str, box: tuple[int, int, int, int], angle: float, period: int) -> Image.Image:
    """The shape's pixels that fall on every other stripe: the texture of a large distractor."""
    mask = Image.new("L", (SIZE, SIZE), 0)
    _draw_shape(ImageDraw.Draw(mask), shape, box, 255)
    stripes = Image.new("L", (SIZE, SIZE), 0)
    pixels = stripes.load()
    ca, sa = math.cos(angle), math.sin(angle)
    for y in range(box[1], box[3] + 1):
        for x in range(box[0], box[2] + 1):
            if int((x * ca + y * sa) // period) % 2 == 0:
                pixels[x, y] = 255
    return Image.composite(mask, Image.new("L", (SIZE, SIZE), 0), stripes)


def _free(box: tuple[int, int, int, int], taken: list[tuple[int, int, int, int]], margin: int) -> bool:
    return all(
        box[2] + margin < t[0] or t[2] + margin < box[0] or box[3] + margin < t[1] or t[3] + margin < box[1]
        for t in taken
    )


def _place(rng: random.Random, size: int, taken: list[tuple[int, int, int, int]], margin: int):
    """A free box of side ``size`` anywhere (a large distractor), or None."""
    for _ in range(200):
        x0 = rng.randint(2, SIZE - size - 2)
        y0 = rng.randint(2, SIZE - size - 2)
        box = (x0, y0, x0 + size, y0 + size)
        if _free(box, taken, margin):
            return box
    return None


def _place_on_grid(rng: random.Random, size: int, taken: list[tuple[int, int, int, int]]):
    """A free box of whole patches (inclusive pixel corners) wholly left or right of the middle, or None."""
    cells = SIZE // GRID_STEP - size // GRID_STEP
    for _ in range(200):
        x0, y0 = (GRID_STEP * rng.randint(0, cells) for _ in range(2))
        box = (x0, y0, x0 + size - 1, y0 + size - 1)
        if (box[2] < SIZE // 2 or box[0] >= SIZE // 2) and _free(box, taken, GRID_STEP - 1):
            return box
    return None


def _questions(rng: random.Random, small: list[Thing], letter: Thing) -> list[Question]:
    out = []
    for thing in small:
        out.append(Question(f"What colour is the small {thing.name}?", thing.colour, "colour", thing))
        out.append(Question(f"What shape is the small {thing.colour} object?", thing.name, "shape", thing))
        out.append(
            Question(f"Is the small {thing.name} on the left or the right?", thing.side, "side", thing)
        )
    out.append(Question("Which letter is on the white tile?", letter.name, "letter", letter))
    rng.shuffle(out)
    return out


def make_scene(split: str, index: int) -> Scene:
    """Scene ``index`` of ``split`` (deterministic; see the module docstring)."""
    rng = scene_rng(split, index)
    while True:
        scene = _try_scene(rng, split, index)
        if scene is not None:
            return scene


def _try_scene(rng: random.Random, split: str, index: int) -> Scene | None:
    background = tuple(rng.randint(200, 250) for _ in range(3))
    image = Image.new("RGB", (SIZE, SIZE), background)
    draw = ImageDraw.Draw(image)
    taken: list[tuple[int, int, int, int]] = []
    things: list[Thing] = []
    palette = list(COLOURS)
    for _ in range(rng.choice((1, 2))):
        box = _place(rng, rng.randint(56, 80), taken, 6)
        if box is None:
            return None
        shape, colour, other = rng.choice(SHAPES), *rng.sample(palette, 2)
        _draw_shape(draw, shape, box, COLOURS[colour])
        image.paste(
            COLOURS[other], (0, 0), _stripe_mask(shape, box, rng.uniform(0, math.pi), rng.randint(5, 8))
        )
        taken.append(box)
        things.append(Thing("shape", shape, colour, box, large=True))
    small: list[Thing] = []
    for shape, colour in zip(rng.sample(SHAPES, rng.choice((2, 3))), rng.sample(palette, 3), strict=False):
        box = _place_on_grid(rng, rng.choice((16, 24)), taken)
        if box is None:
            return None
        _draw_shape(draw, shape, box, COLOURS[colour])
        taken.append(box)
        small.append(Thing("shape", shape, colour, box))
    box = _place_on_grid(rng, TILE, taken)
    if box is None:
        return None
    letter = rng.choice(sorted(LETTERS))
    draw.rectangle(box, fill=(255, 255, 255), outline=(60, 60, 60))
    x0, y0, span = box[0] + 4, box[1] + 4, TILE - 9
    for sx, sy, ex, ey in LETTERS[letter]:
        draw.line((x0 + sx * span, y0 + sy * span, x0 + ex * span, y0 + ey * span), fill=(0, 0, 0), width=3)
    letter_thing = Thing("letter", letter, "black", box)
    things += [*small, letter_thing]
    return Scene(split, index, image, things, _questions(rng, small, letter_thing))
