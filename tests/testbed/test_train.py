"""The testbed's training pieces: branch packing is exactly single-turn prompting, and stage 1's word
targets lay a small shape out like text, balanced over words; the projector refit is optimal; batches
mix the two sources as asked."""

import math
import random

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from priortr.testbed import assemble, scenes, train
from priortr.testbed.architecture import GRID, IMAGE_TOKEN

QUESTIONS = [
    ("What colour is the small circle?", "red"),
    ("Which letter is on the white tile?", "A"),
    ("Is the small square on the left or the right?", "left"),
]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(assemble.gguf_directory(), gguf_file=assemble.GGUF_FILE)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    return tokenizer


@pytest.fixture(scope="module")
def tiny_lm(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


def test_each_branch_sees_exactly_its_single_turn_prompt(tokenizer, tiny_lm):
    items = [
        train.branches(QUESTIONS, tokenizer, random.Random(0), 12),
        train.branches(QUESTIONS[:2], tokenizer, random.Random(1), 12),
    ]
    batch = train.collate(items, tokenizer.pad_token_id or 0)
    packed = tiny_lm(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits
    answers = []
    for row, (ids, labels, _, branch) in enumerate(items):
        for number in range(1, max(branch) + 1):
            keep = [i for i, b in enumerate(branch) if b in (0, number)]
            single = [ids[i] for i in keep]
            text = tokenizer.decode(single)
            assert text.count(IMAGE_TOKEN) == GRID * GRID and text.endswith("<|im_end|>")
            assert f"{IMAGE_TOKEN}\n" in text and text.count("<|im_start|>") == 2
            reference = tiny_lm(input_ids=torch.tensor([single])).logits[0]
            torch.testing.assert_close(packed[row, keep], reference, atol=1e-5, rtol=1e-4)
            answers.append(tokenizer.decode([labels[i] for i in keep if labels[i] != train.IGNORE]))
    assert sorted(answers) == sorted(f"{a}<|im_end|>" for a in ["red", "A", "left", "red", "A"])


def test_without_the_branch_mask_the_branches_would_see_each_other(tokenizer, tiny_lm):
    """Negative control: the same packed ids under a plain causal mask do not match single-turn logits."""
    ids, _, positions, branch = train.branches(QUESTIONS, tokenizer, random.Random(0), 12)
    causal = tiny_lm(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions])).logits[0]
    last = [i for i, b in enumerate(branch) if b in (0, 3)]
    reference = tiny_lm(input_ids=torch.tensor([[ids[i] for i in last]])).logits[0]
    assert not torch.allclose(causal[last], reference, atol=1e-3)


def test_branch_mask_hides_other_branches_and_padding():
    branch = torch.tensor([[0, 0, 1, 1, 2, -1]])
    mask = train.branch_mask(branch, branch >= 0)[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ]


def test_word_targets_lay_a_small_shape_out_like_text(tokenizer):
    torch.manual_seed(0)
    embeddings = torch.randn(len(tokenizer), 8)
    targets = train.WordTargets(embeddings, tokenizer)
    scene, square = next(
        (scene, thing)
        for scene in map(lambda i: scenes.make_scene("train", i), range(50))
        for thing in scene.things
        if thing.name == "square" and not thing.large
    )
    labels = {k: v[None] for k, v in train.scene_labels(scene).items()}
    target = targets(labels["word"])

    def row(word):
        return embeddings[tokenizer(word)["input_ids"][0]]

    side = (square.box[2] + 1 - square.box[0]) // 8
    top, left = square.box[1] // 8, square.box[0] // 8
    grid = target[0].view(GRID, GRID, -1)
    expected = [[f" {square.colour}"] + [" square"] * (side - 1)] * (side - 1)
    expected += [[f" {square.side}"] + [" square"] * (side - 1)]
    for r, words in enumerate(expected):
        for c, word in enumerate(words):
            torch.testing.assert_close(grid[top + r, left + c], row(word))
    background = torch.nonzero(labels["size"][0] == 0).flatten()[0]
    torch.testing.assert_close(target[0, background], row(train.FILLER_WORD))
    large = torch.nonzero(labels["size"][0] == train.SIZE_LABELS.index("large")).flatten()[0]
    torch.testing.assert_close(target[0, large], row(f" {train.LARGE_WORD}"))


def test_word_balance_gives_every_word_present_the_same_total():
    words = torch.tensor([[0, 0, 0, 5], [0, 0, 5, 9]])
    expected = torch.tensor([[1 / 15, 1 / 15, 1 / 15, 1 / 6], [1 / 15, 1 / 15, 1 / 6, 1 / 3]])
    torch.testing.assert_close(train.word_balance(words), expected)


def test_word_contrast_by_hand():
    """Two words one unit apart (scale 1, so a distance of 1/2 in word_loss's units): a patch on its own
    word pays log(1 + e^-10), one halfway pays log 2, each weighted one half (word_balance)."""
    table = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    projected = torch.tensor([[[0.0, 0.0], [0.5, 0.0]]])
    words = torch.tensor([[0, 1]])
    expected = 0.5 * math.log1p(math.exp(-1 / (2 * train.WORD_TEMPERATURE))) + 0.5 * math.log(2)
    assert train.word_contrast(projected, table, words, 1.0).item() == pytest.approx(expected, rel=1e-5)


def test_word_contrast_separates_close_words_that_the_squared_error_barely_does():
    """Negative control for its purpose: moving a patch from its own word to halfway towards a near
    neighbour costs word_loss a quarter of their squared distance, but word_contrast about log 2."""
    table = torch.tensor([[1.0, 0.0], [1.0, 0.6], [-1.0, 0.0]])
    words = torch.tensor([[0]])
    on, halfway = torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[1.0, 0.3]]])
    squared = [train.word_loss(p, table[words], words, 1.0).item() for p in (on, halfway)]
    contrast = [train.word_contrast(p, table, words, 1.0).item() for p in (on, halfway)]
    assert squared[1] - squared[0] == pytest.approx(0.09 / 2)
    assert contrast[1] - contrast[0] > 0.6


def test_load_vision_reads_a_trained_files_tower_and_projector(tokenizer, tiny_lm, tmp_path):
    model = assemble.llava(tiny_lm, tokenizer)
    path = tmp_path / "trained.safetensors"
    assemble.save_trained(path, model, {}, {"align_steps": 0})
    state = train.load_vision(path)
    for name, part in (("tower", model.model.vision_tower), ("projector", model.model.multi_modal_projector)):
        expected = {k: v.to(torch.float16).float() for k, v in part.state_dict().items()}
        assert state[name].keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(state[name][key], value)


def test_refit_projector_finds_the_weighted_least_squares_optimum(tokenizer, tiny_lm):
    """At the refit output layer the weighted error's gradient all but vanishes (the small ridge term
    remains); at the random initial layer it does not, and the error is larger there."""
    tower, projector, targets = train.vision_parts(tokenizer, tiny_lm)
    images = [scenes.make_scene("train", i).image for i in range(3)]
    labels = [train.scene_labels(scenes.make_scene("train", i)) for i in range(3)]
    pool = {
        "pixel_values": train.pixel_values(images * 2, assemble.image_processor()),
        "labels": {k: torch.stack([lab[k] for lab in labels * 2]) for k in train.HEADS},
    }
    with torch.no_grad():
        features = train.patch_features(tower.eval(), pool["pixel_values"])
    target = targets(pool["labels"]["word"])
    weight = train.word_balance(pool["labels"]["word"])

    def error_and_gradient() -> tuple[float, torch.Tensor]:
        projector.zero_grad()
        total = ((projector(features) - target).pow(2).sum(-1) * weight).sum()
        total.backward()
        return float(total.detach()), projector.linear_2.weight.grad.clone()

    before, initial = error_and_gradient()
    train.refit_projector(tower, projector, targets, pool, n_scenes=3, per_source=3)
    after, refit = error_and_gradient()
    assert after < before
    assert refit.norm() < 0.05 * initial.norm()


@pytest.mark.parametrize(("share", "scenes_wanted"), [(0.0, 0), (0.75, 6), (1.0, 8)])
def test_pick_images_draws_the_scene_share_from_the_scenes(share, scenes_wanted):
    picked = train.pick_images(10, 30, 8, share, random.Random(0))
    assert len(picked) == 8
    assert sum(i < 10 for i in picked) == scenes_wanted
    assert all(0 <= i < 30 for i in picked)
    assert picked == train.pick_images(10, 30, 8, share, random.Random(0))


@pytest.mark.parametrize(
    "extra", [["--scene-share", "1.5"], ["--resume", "a.safetensors", "--adapter", "b.safetensors"]]
)
def test_training_rejects_contradictory_options(tmp_path, extra, capsys):
    with pytest.raises(SystemExit):
        train.main(["--out", str(tmp_path), "--stage", "align", *extra])
    assert "give" in capsys.readouterr().err
