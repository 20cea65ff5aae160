"""The testbed's question sets: deterministic scenes whose answers are true of the drawn pixels, and fixed
named splits."""

from collections import Counter

import pytest
import torch

from priortr.testbed import data, scenes, train


def pixels(image) -> torch.Tensor:
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(image.height, image.width, 3)


def test_a_scene_is_a_pure_function_of_split_and_index():
    first, again = scenes.make_scene("test", 3), scenes.make_scene("test", 3)
    assert torch.equal(pixels(first.image), pixels(again.image))
    assert first.questions == again.questions
    assert not torch.equal(pixels(first.image), pixels(scenes.make_scene("test", 4).image))
    assert not torch.equal(pixels(first.image), pixels(scenes.make_scene("train", 3).image))


def test_the_generator_does_not_depend_on_global_random_state():
    import random

    random.seed(1)
    torch.manual_seed(1)
    first = scenes.make_scene("train", 11)
    random.seed(2)
    torch.manual_seed(2)
    assert torch.equal(pixels(first.image), pixels(scenes.make_scene("train", 11).image))


@pytest.mark.parametrize("index", range(12))
def test_answers_are_true_of_the_drawn_pixels(index):
    scene = scenes.make_scene("train", index)
    image = pixels(scene.image)
    small = [t for t in scene.things if t.kind == "shape" and not t.large]
    assert 2 <= len(small) <= 3
    assert len({t.name for t in small}) == len(small) and len({t.colour for t in small}) == len(small)
    for question in scene.questions:
        thing = question.target
        x0, y0, x1, y1 = thing.box
        centre = image[(y0 + y1) // 2, (x0 + x1) // 2]
        if question.kind == "colour":
            assert question.answer == thing.colour
            assert centre.tolist() == list(scenes.COLOURS[thing.colour])
        elif question.kind == "shape":
            assert question.answer == thing.name and thing.colour in question.text
        elif question.kind == "side":
            assert question.answer == ("left" if x0 + x1 < scenes.SIZE else "right")
            assert x1 < scenes.SIZE // 2 or x0 >= scenes.SIZE // 2, "wholly on one side"
        else:
            assert question.answer in scenes.LETTERS
            tile = image[y0 + 1 : y1, x0 + 1 : x1]
            assert (tile == 0).all(-1).any(), "the letter strokes are drawn in black on the tile"


@pytest.mark.parametrize("index", range(12))
def test_small_shapes_and_the_letter_tile_are_whole_patches_on_one_side(index):
    for thing in scenes.make_scene("test", index).things:
        if thing.large:
            continue
        x0, y0, x1, y1 = thing.box
        assert x0 % 8 == 0 and y0 % 8 == 0 and (x1 + 1) % 8 == 0 and (y1 + 1) % 8 == 0
        assert x1 < scenes.SIZE // 2 or x0 >= scenes.SIZE // 2


def test_no_two_things_overlap():
    for index in range(20):
        boxes = [t.box for t in scenes.make_scene("test", index).things]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                assert a[2] < b[0] or b[2] < a[0] or a[3] < b[1] or b[3] < a[1]


def test_dense_labels_mark_the_patches_under_each_object():
    scene = scenes.make_scene("train", 0)
    labels = train.scene_labels(scene)
    letter = next(t for t in scene.things if t.kind == "letter")
    marked = labels["letter"].view(24, 24) == train.LETTER_LABELS.index(letter.name)
    rows, cols = torch.nonzero(marked, as_tuple=True)
    assert rows.numel() >= 4
    assert rows.min() * 8 >= letter.box[1] - 8 and cols.min() * 8 >= letter.box[0] - 8
    assert (labels["colour"] > 0).sum() > 0 and (labels["letter"] == train.IGNORE).sum() > 500
    assert (labels["size"] == 0).sum() > 400, "background patches are labelled for size only"


def test_scene_test_split_is_fixed_and_balanced():
    split = data.load_split("scenes-test")
    assert len(split) == data.SCENE_TEST_SIZE
    assert Counter(s.kind for s in split) == dict.fromkeys(scenes.QUESTION_KINDS, data.SCENE_TEST_SIZE // 4)
    assert split == data.load_split("scenes-test")
    assert {s.image_id.split("/")[0] for s in split} == {"test"}


def test_a_limit_keeps_a_fixed_subset_that_mixes_question_kinds():
    subset = data.load_split("scenes-test", limit=40)
    assert subset == data.load_split("scenes-test", limit=40)
    assert len(subset) == 40 and len({s.image_id for s in subset}) == 40
    assert set(Counter(s.kind for s in subset)) == set(scenes.QUESTION_KINDS)
    with pytest.raises(ValueError, match="at least 1"):
        data.load_split("scenes-test", limit=0)


def test_easy_vqa_test_split_is_the_package_test_set():
    split = data.load_split("easy-vqa-test")
    assert len(split) == 9673
    assert Counter(s.kind for s in split)["yes/no"] == 3611 + 3525
    image = split[0].image()
    assert image.size == (64, 64) and image.mode == "RGB"


def test_unknown_split_names_the_choices():
    with pytest.raises(ValueError, match="scenes-test"):
        data.load_split("scenes-valid")


def test_scenes_train_is_training_scenes_only_for_calibration():
    split = data.load_split("scenes-train", limit=12)
    assert {s.image_id.split("/")[0] for s in split} == {"train"}
    assert split == data.load_split("scenes-train", limit=12)
    assert set(Counter(s.kind for s in split)) == set(scenes.QUESTION_KINDS)


@pytest.mark.parametrize("split", ["train", "test"])
def test_easy_vqa_attributes_read_from_pixels_agree_with_the_answers(split):
    by_image: dict[str, list[data.Sample]] = {}
    for sample in data.easy_vqa_samples(split):
        by_image.setdefault(sample.image_id, []).append(sample)
    checked = 0
    for image_id in list(by_image)[:60]:
        shape, colour = train.easy_vqa_attributes(data.load_image("easy-vqa", image_id))
        for sample in by_image[image_id]:
            if sample.kind in ("shape", "colour"):
                assert sample.answer == (shape if sample.kind == "shape" else colour), sample
                checked += 1
    assert checked > 60


def test_easy_vqa_words_name_the_shape_its_colour_and_side():
    """Stage 1's word layout of an easy-VQA image: only the shape's own words, its colour leading
    most rows, its side leading the last one, and its shape word the rest of each row."""
    image_id = next(iter(data.easy_vqa_samples("train"))).image_id
    image = data.load_image("easy-vqa", image_id)
    shape, colour = train.easy_vqa_attributes(image)
    words = train.easy_vqa_labels(image)["word"].view(24, 24)
    rows = [row for row in words if (row > 0).sum() > 1]
    leading = [train.WORDS[row[row > 0][0]] for row in rows]
    assert len(rows) > 5 and set(leading[:-1]) == {colour} and leading[-1] in ("left", "right")
    assert {train.WORDS[w] for row in rows for w in row[row > 0][1:]} == {shape}
    assert set(words.unique().tolist()) <= {0, *(train.WORDS.index(w) for w in (shape, colour, *leading))}
