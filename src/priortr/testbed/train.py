"""Train the testbed's vision tower, projector and LoRA adapter (``python -m priortr.testbed.train``).

Two stages, because a forward and backward pass through SmolLM2 costs ~1.6 s per 576-token sample on
the 2-core CPU (bfloat16) and no accelerator was available:

1. ``vision``: the CLIP tower learns, per patch, the colour, shape, size, side and letter of the object
   under it (dense labels from the scene generator; shape and colour masks for easy-VQA), and the
   projector learns to place each patch at the input embedding of one word, laid out like text
   (``patch_words``: a small red circle on the left reads " red circle" / " left circle" row by row).
   The language model then starts out reading an image as a grid of words whose attributes it binds
   as it binds adjectives to nouns, instead of noise, which is what makes stage 2 short enough for a
   CPU. Cheap: the language model only supplies its embedding table.
2. ``align``: the projector and a rank-8 LoRA on SmolLM2's attention projections (and the tower, at a
   lower learning rate; ``--projector-lr-scale`` slows the projector too) learn to answer, end to end
   through the stock ``LlavaForConditionalGeneration``.
   All questions of an image share one encoded image: they are packed as branches after one 576-token
   prefix, each branch attending to the prefix and itself only (a 4D mask, positions restarting after
   the prefix), so every branch sees exactly the single-turn prompt that evaluation uses.

Everything is seeded; the data version is ``scenes.VERSION`` plus easy-VQA 1.0's train split. Curves go
to ``<out>/log.jsonl`` (``--stage plot`` draws them); ``--stage align`` writes the shipped file with
``assemble.save_trained`` every ``--save-every`` steps.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from transformers import CLIPVisionModel

from priortr.testbed import architecture, data, scenes
from priortr.testbed.architecture import GRID, IMAGE_SIZE, PATCH_SIZE

EASY_SHAPES = ("circle", "rectangle", "triangle")
EASY_RGB = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
    "teal": (0, 128, 128),
    "brown": (165, 42, 42),
    "yellow": (255, 255, 0),
}
EASY_COLOURS = tuple(EASY_RGB)
SHAPE_LABELS = ("none", *scenes.SHAPES, "rectangle")
COLOUR_LABELS = ("none", *dict.fromkeys((*scenes.COLOURS, *EASY_COLOURS)))
SIZE_LABELS = ("none", "small", "large")
SIDE_LABELS = ("none", "left", "right")
LETTER_LABELS = ("none", *sorted(scenes.LETTERS))
# Stage 1's target for a patch that shows nothing, then for a large distractor's patches.
FILLER_WORD = "."
LARGE_WORD = "large"
WORDS = tuple(
    dict.fromkeys(
        (FILLER_WORD, LARGE_WORD, *COLOUR_LABELS[1:], *SHAPE_LABELS[1:], *SIDE_LABELS[1:], *LETTER_LABELS[1:])
    )
)
HEADS = {
    "colour": COLOUR_LABELS,
    "shape": SHAPE_LABELS,
    "size": SIZE_LABELS,
    "side": SIDE_LABELS,
    "letter": LETTER_LABELS,
    "word": WORDS,
}
IGNORE = -100
# Softmax temperature of ``word_contrast``, in ``word_loss``'s units, in which the two closest word
# targets (" green" and " blue") lie 0.32 apart and " left" and " right" 0.72.
WORD_TEMPERATURE = 0.05


def pixel_values(images, processor) -> torch.Tensor:
    return processor(images=images, return_tensors="pt")["pixel_values"]


def patch_features(tower: CLIPVisionModel, pixels: torch.Tensor) -> torch.Tensor:
    """What LLaVA hands the projector: the last layer's patch features, [CLS] dropped."""
    return tower(pixels, output_hidden_states=True).hidden_states[-1][:, 1:]


def _pixels(image) -> torch.Tensor:
    """A PIL image as a float tensor (height, width, channels)."""
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).float()
    return data.view(image.height, image.width, -1)


def _patch_cover(mask: torch.Tensor) -> torch.Tensor:
    """The fraction of each patch that a (height, width) mask in [0, 1] covers, in token order."""
    return F.avg_pool2d(mask[None, None].float(), PATCH_SIZE).flatten()


def patch_words(owner: torch.Tensor, things: list[scenes.Thing]) -> torch.Tensor:
    """The word each patch stands for (an index into ``WORDS``), laid out like text in token order, so
    that SmolLM2 can bind a small object's attributes the way it binds "red circle" in a sentence: in
    each row of two or more of a shape's patches, the first is an adjective (its side in the shape's
    last such row, its colour in the others) and the rest are its shape word. Letter tiles are their
    letter, large distractors ``LARGE_WORD``, background the filler. ``owner`` is the index into
    ``things`` of the object each patch shows (-1: none), in token order."""
    words = torch.zeros(GRID, GRID, dtype=torch.long)
    grid = owner.view(GRID, GRID)
    for number, thing in enumerate(things):
        mine = grid == number
        if thing.large or thing.kind == "letter":
            words[mine] = WORDS.index(LARGE_WORD if thing.large else thing.name)
            continue
        words[mine] = WORDS.index(thing.name)
        rows = [row for row in range(GRID) if mine[row].sum() > 1]
        for row in rows:
            first = torch.nonzero(mine[row]).flatten()[0]
            words[row, first] = WORDS.index(thing.side if row == rows[-1] else thing.colour)
    return words.flatten()


def scene_labels(scene: scenes.Scene) -> dict[str, torch.Tensor]:
    """Per-patch labels of the object covering the most of a patch (at least 15%), and the patch's word
    (``patch_words``). Only ``size``, ``side`` and ``word`` label background patches ("none", the filler
    word): the attribute heads learn from object patches alone, so
    that the few patches of a small object are not outweighed by the background. A large shape's colour
    is not labelled (its stripes make it two colours; no question asks it)."""
    labels = {name: torch.full((GRID * GRID,), IGNORE, dtype=torch.long) for name in HEADS}
    labels["size"].zero_()
    labels["side"].zero_()
    cover = torch.stack([_patch_cover(_pixels(scenes.thing_mask(t))[..., 0] / 255) for t in scene.things])
    best, owner = cover.max(0)
    owner = torch.where(best >= 0.15, owner, -1)
    labels["word"] = patch_words(owner, scene.things)
    for patch in torch.nonzero(owner >= 0).flatten().tolist():
        thing = scene.things[owner[patch]]
        labels["side"][patch] = SIDE_LABELS.index(thing.side)
        labels["size"][patch] = SIZE_LABELS.index("large" if thing.large else "small")
        if thing.kind == "letter":
            labels["letter"][patch] = LETTER_LABELS.index(thing.name)
        else:
            labels["shape"][patch] = SHAPE_LABELS.index(thing.name)
            if not thing.large:
                labels["colour"][patch] = COLOUR_LABELS.index(thing.colour)
    return labels


def _foreground(image) -> tuple[torch.Tensor, torch.Tensor]:
    """An easy-VQA image's pixels (height, width, 3) and where they are far from its plain background."""
    pixels = _pixels(image)
    return pixels, (pixels - pixels[0, 0]).abs().sum(-1) > 60


def _box(mask: torch.Tensor) -> tuple[int, int, int, int]:
    """The inclusive pixel box (x0, y0, x1, y1) of a (height, width) boolean mask."""
    rows, cols = torch.nonzero(mask, as_tuple=True)
    return cols.min().item(), rows.min().item(), cols.max().item(), rows.max().item()


def easy_vqa_attributes(image) -> tuple[str, str]:
    """The shape and colour easy-VQA drew: the colour is the nearest of its eight exact RGB values to
    the shape's median pixel, the shape follows from how much of its bounding box it fills (rectangle
    1, circle ~0.79, triangle ~0.5). Read from pixels because the questions do not always name them
    (agrees with every shape and colour answer of the first 400 train and 400 test images)."""
    pixels, far = _foreground(image)
    x0, y0, x1, y1 = _box(far)
    fill = far.sum() / ((x1 - x0 + 1) * (y1 - y0 + 1))
    median = pixels[far].median(0).values
    colour = min(EASY_COLOURS, key=lambda c: (torch.tensor(EASY_RGB[c]) - median).abs().sum().item())
    shape = "rectangle" if fill > 0.9 else "circle" if fill > 0.72 else "triangle"
    return shape, colour


def easy_vqa_labels(image) -> dict[str, torch.Tensor]:
    """The shape's patches carry its shape and colour, and the words of ``patch_words``."""
    _, far = _foreground(image.resize((IMAGE_SIZE, IMAGE_SIZE)))
    on = _patch_cover(far) >= 0.15
    shape, colour = easy_vqa_attributes(image)
    labels = {name: torch.full((GRID * GRID,), IGNORE, dtype=torch.long) for name in HEADS}
    labels["shape"] = torch.where(on, SHAPE_LABELS.index(shape), IGNORE)
    labels["colour"] = torch.where(on, COLOUR_LABELS.index(colour), IGNORE)
    labels["word"] = patch_words(torch.where(on, 0, -1), [scenes.Thing("shape", shape, colour, _box(far))])
    return labels


def build_pool(n_scenes: int, processor) -> dict:
    """Training images (uint8-free: normalised pixel values), their dense labels and their questions."""
    images, labels, questions = [], [], []
    for index in range(n_scenes):
        scene = scenes.make_scene("train", index)
        images.append(scene.image)
        labels.append(scene_labels(scene))
        questions.append([(q.text, q.answer) for q in scene.questions])
    by_image: dict[str, list[data.Sample]] = {}
    for sample in data.easy_vqa_samples("train"):
        by_image.setdefault(sample.image_id, []).append(sample)
    for image_id, samples in by_image.items():
        image = data.load_image("easy-vqa", image_id)
        images.append(image)
        labels.append(easy_vqa_labels(image))
        questions.append([(s.question, s.answer) for s in samples])
    pixels = torch.cat([pixel_values(images[i : i + 256], processor) for i in range(0, len(images), 256)])
    stacked = {name: torch.stack([lab[name] for lab in labels]) for name in HEADS}
    return {"pixel_values": pixels.to(torch.bfloat16), "labels": stacked, "questions": questions}


class DenseHeads(nn.Module):
    """Stage-1 probes on the features LLaVA hands the projector (last layer, [CLS] dropped)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({name: nn.Linear(hidden, len(table)) for name, table in HEADS.items()})

    def forward(self, features: torch.Tensor, labels: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        losses = {
            name: F.cross_entropy(head(features).flatten(0, 1), labels[name].flatten(), ignore_index=IGNORE)
            for name, head in self.heads.items()
            if name != "word"
        }
        words = labels["word"].flatten()
        each = F.cross_entropy(self.heads["word"](features).flatten(0, 1), words, reduction="none")
        losses["word"] = (each * word_balance(words)).sum()
        return losses


class WordTargets(nn.Module):
    """Per-patch targets for the projector: the input embedding of the word ``patch_words`` assigns a
    patch, as it starts a word inside a sentence (with its leading space; the filler without)."""

    def __init__(self, embeddings: torch.Tensor, tokenizer) -> None:
        super().__init__()
        ids = [tokenizer(word if word == FILLER_WORD else f" {word}")["input_ids"][0] for word in WORDS]
        self.register_buffer("table", embeddings.detach().float()[ids])
        self.scale = float(embeddings.detach().float().pow(2).mean())

    def forward(self, words: torch.Tensor) -> torch.Tensor:
        """Targets ``(batch, patches, hidden)`` for word labels ``(batch, patches)``."""
        return self.table[words]


def word_balance(words: torch.Tensor) -> torch.Tensor:
    """Per-patch weights summing to 1 that give every word present the same total: a small shape's
    one colour patch per row counts as much as the hundreds of filler and distractor patches."""
    flat = words.flatten()
    _, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
    return (1.0 / (counts[inverse] * len(counts))).view(words.shape)


def word_loss(
    projected: torch.Tensor, target: torch.Tensor, words: torch.Tensor, scale: float
) -> torch.Tensor:
    """Mean squared error in units of the embedding table's mean square, balanced over words
    (``word_balance``)."""
    error = (projected.float() - target).pow(2).mean(-1) / scale
    return (error * word_balance(words)).sum()


def word_contrast(
    projected: torch.Tensor, table: torch.Tensor, words: torch.Tensor, scale: float
) -> torch.Tensor:
    """Cross-entropy of each patch's word against every other word, with logits minus its squared
    distance to each word's target (``word_loss``'s units) over ``WORD_TEMPERATURE``, balanced over
    words. The squared error charges little for drifting towards a close neighbour (halfway costs a
    quarter of their distance), while the language model reads the nearest word; this term keeps each
    patch nearest its own. Used when stage 1 restarts from an aligned model's projector, which
    alignment had moved off the word targets (docs/accuracy.md, step 5)."""
    distance = torch.cdist(projected.float(), table.expand(len(projected), -1, -1)).pow(2)
    logits = -distance / (table.shape[-1] * scale * WORD_TEMPERATURE)
    each = F.cross_entropy(logits.flatten(0, 1), words.flatten(), reduction="none")
    return (each * word_balance(words).flatten()).sum()


def load_vision(path: Path) -> dict:
    """A stage-1 state: a ``vision.pt``, or the tower and projector of a trained testbed file (to
    continue stage 1 from an aligned model, whose adapter already reads that projector's words)."""
    from priortr.testbed import assemble

    if path.suffix == ".safetensors":
        parts, _ = assemble.read_trained(path)
        return {"tower": parts["vision_tower"], "projector": parts["projector"]}
    return torch.load(path)


def vision_parts(tokenizer, language_model):
    """A fresh tower and LLaVA projector of the testbed's shape, and the word targets."""
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    config = architecture.llava_config(
        language_model.config, tokenizer.convert_tokens_to_ids(architecture.IMAGE_TOKEN)
    )
    targets = WordTargets(language_model.get_input_embeddings().weight, tokenizer)
    return CLIPVisionModel(config.vision_config), LlavaMultiModalProjector(config), targets


@torch.no_grad()
def refit_projector(tower, projector, targets: WordTargets, pool: dict, n_scenes: int, per_source: int = 200):
    """Solve the projector's output layer for the word targets in closed form (weighted ridge
    regression on the hidden layer, over ``per_source`` random scenes and as many easy-VQA images),
    balanced over words (``word_balance``). A few minutes of SGD leave the output
    layer far from this optimum, and the language model reads exactly this layer."""
    generator = torch.Generator().manual_seed(1)
    n = pool["pixel_values"].shape[0]
    picked = torch.cat(
        [
            torch.randperm(n_scenes, generator=generator)[:per_source],
            n_scenes + torch.randperm(n - n_scenes, generator=generator)[:per_source],
        ]
    )
    hidden = []
    for chunk in picked.split(40):
        features = patch_features(tower, pool["pixel_values"][chunk].float())
        hidden.append(projector.act(projector.linear_1(features)).flatten(0, 1))
    words = pool["labels"]["word"][picked].flatten()
    inputs = torch.cat(hidden).double()
    inputs = torch.cat([inputs, torch.ones(len(inputs), 1, dtype=torch.double)], 1)
    weight = (word_balance(words) * len(inputs)).double()[:, None]
    gram = inputs.T @ (inputs * weight) + 1e-3 * len(inputs) * torch.eye(inputs.shape[1], dtype=torch.double)
    solution = torch.linalg.solve(gram, inputs.T @ (targets(words).double() * weight))
    projector.linear_2.weight.copy_(solution[:-1].T)
    projector.linear_2.bias.copy_(solution[-1])


def pick_images(n_scenes: int, n: int, count: int, scene_share: float, rng: random.Random) -> list[int]:
    """``count`` pool indices, ``round(count * scene_share)`` of them scenes (the pool's first
    ``n_scenes`` images) and the rest easy-VQA images, each drawn uniformly within its source."""
    scenes_wanted = round(count * scene_share)
    return [rng.randrange(n_scenes) for _ in range(scenes_wanted)] + [
        rng.randrange(n_scenes, n) for _ in range(count - scenes_wanted)
    ]


def train_vision(pool: dict, args, log) -> dict:
    from priortr.testbed import assemble

    language_model, tokenizer = assemble.smollm2()
    tower, projector, targets = vision_parts(tokenizer, language_model)
    del language_model
    if args.init is not None:
        state = load_vision(args.init)
        tower.load_state_dict(state["tower"])
        projector.load_state_dict(state["projector"])
    heads = DenseHeads(tower.config.hidden_size)
    params = [*tower.parameters(), *projector.parameters(), *heads.parameters()]
    optimiser = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, args.lr, total_steps=args.steps, pct_start=0.05)
    n = pool["pixel_values"].shape[0]
    rng = random.Random(args.seed)
    start = time.time()
    for step in range(args.steps):
        idx = pick_images(args.scenes, n, args.batch, args.scene_share, rng)
        labels = {k: v[idx] for k, v in pool["labels"].items()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            features = patch_features(tower, pool["pixel_values"][idx].float())
            losses = heads(features.float(), labels)
            words = labels["word"]
            projected = projector(features)
            losses["words"] = word_loss(projected, targets(words), words, targets.scale)
            if args.word_contrast:
                contrast = word_contrast(projected, targets.table, words, targets.scale)
                losses["contrast"] = args.word_contrast * contrast
        loss = sum(losses.values())
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        schedule.step()
        if step % 25 == 0 or step == args.steps - 1:
            log(
                {
                    "stage": "vision",
                    "step": step,
                    "loss": loss.item(),
                    "seconds": time.time() - start,
                    **{k: round(v.item(), 4) for k, v in losses.items()},
                }
            )
    refit_projector(tower.eval(), projector, targets, pool, args.scenes)
    return {"tower": tower.state_dict(), "projector": projector.state_dict()}


def branches(
    questions: list[tuple[str, str]], tokenizer, rng: random.Random, limit: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Up to ``limit`` of an image's questions, each as the single-turn prompt plus its answer, packed
    after one shared prefix ending with the image and its separator. Returns token ids, labels (each
    answer and its end-of-turn token), position ids, and the branch of each token (0: the prefix)."""
    picked = rng.sample(questions, min(limit, len(questions)))
    image = architecture.IMAGE_TOKEN * (GRID * GRID)
    prompts = [
        tokenizer(f"<|im_start|>user\n{image}\n{q}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        for q, _ in picked
    ]
    image_id = tokenizer.convert_tokens_to_ids(architecture.IMAGE_TOKEN)
    shared = max(i for i, t in enumerate(prompts[0]) if t == image_id) + 2
    if any(p[:shared] != prompts[0][:shared] for p in prompts):
        raise ValueError("the questions do not share the image prefix token for token")
    ids, labels = prompts[0][:shared], [IGNORE] * shared
    positions, branch = list(range(shared)), [0] * shared
    for number, (prompt, (_, answer)) in enumerate(zip(prompts, picked, strict=True), start=1):
        reply = tokenizer(f"{answer}<|im_end|>")["input_ids"]
        tail = prompt[shared:] + reply
        ids += tail
        labels += [IGNORE] * (len(prompt) - shared) + reply
        positions += range(shared, shared + len(tail))
        branch += [number] * len(tail)
    return ids, labels, positions, branch


def branch_mask(branch: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Boolean ``(batch, 1, length, length)`` attention: causal, the prefix (branch 0) visible to all,
    a branch to itself only, padding to nobody but itself (a fully masked row would give NaNs)."""
    length = branch.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same = (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
    allowed = causal & same & valid[:, None, :] | torch.eye(length, dtype=torch.bool)
    return allowed[:, None]


def align_model(vision_state: dict, rank: int, alpha: float):
    from priortr.testbed import assemble, lora

    language_model, tokenizer = assemble.smollm2()
    model = assemble.llava(language_model, tokenizer)
    model.set_attn_implementation("sdpa")
    model.model.vision_tower.load_state_dict(vision_state["tower"])
    model.model.multi_modal_projector.load_state_dict(vision_state["projector"])
    model.requires_grad_(False)
    model.model.multi_modal_projector.requires_grad_(True)
    model.model.vision_tower.requires_grad_(True)
    adapters = lora.add(model.model.language_model, rank, alpha)
    return model, tokenizer, adapters


def align_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy on answer tokens, with the LM head applied only where a label is."""
    hidden = model.model(
        input_ids=batch["input_ids"],
        pixel_values=batch["pixel_values"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).last_hidden_state
    targets = batch["labels"][:, 1:]
    where = targets != IGNORE
    logits = model.lm_head(hidden[:, :-1][where]).float()
    truth = targets[where]
    return F.cross_entropy(logits, truth), (logits.argmax(-1) == truth).float().mean()


def collate(
    items: list[tuple[list[int], list[int], list[int], list[int]]], pad_id: int
) -> dict[str, torch.Tensor]:
    width = max(len(item[0]) for item in items)
    columns = [torch.full((len(items), width), fill) for fill in (pad_id, IGNORE, 0, -1)]
    for row, item in enumerate(items):
        for column, values in zip(columns, item, strict=True):
            column[row, : len(values)] = torch.tensor(values)
    input_ids, labels, positions, branch = columns
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": positions,
        "attention_mask": branch_mask(branch, branch >= 0),
    }


def train_align(pool: dict, vision_state: dict, args, log) -> None:
    from priortr.testbed import assemble, lora

    model, tokenizer, adapters = align_model(vision_state, args.rank, args.alpha)
    done_before = 0
    source = args.resume or args.adapter
    if source is not None:
        parts, metadata = assemble.read_trained(source)
        lora.load(model.model.language_model, parts["lora"])
    if args.resume is not None:
        done_before = int(metadata["align_steps"])
        model.model.vision_tower.load_state_dict(parts["vision_tower"])
        model.model.multi_modal_projector.load_state_dict(parts["projector"])
    groups = [
        (list(adapters), args.lr),
        (list(model.model.multi_modal_projector.parameters()), args.lr * args.projector_lr_scale),
        (list(model.model.vision_tower.parameters()), args.lr * args.tower_lr_scale),
    ]
    optimiser = torch.optim.AdamW([{"params": p, "lr": lr} for p, lr in groups], weight_decay=0.0)
    peaks = [lr for _, lr in groups]
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, peaks, total_steps=args.steps, pct_start=0.05)
    params = [p for group, _ in groups for p in group]
    rng = random.Random(args.seed)
    n = pool["pixel_values"].shape[0]
    start = time.time()
    for step in range(args.steps):
        idx = pick_images(args.scenes, n, args.batch, args.scene_share, rng)
        batch = collate(
            [branches(pool["questions"][i], tokenizer, rng, args.questions) for i in idx],
            tokenizer.pad_token_id or 0,
        )
        batch["pixel_values"] = pool["pixel_values"][idx].float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, accuracy = align_loss(model, batch)
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        schedule.step()
        log(
            {
                "stage": "align",
                "step": step,
                "loss": round(loss.item(), 4),
                "token_accuracy": round(accuracy.item(), 4),
                "seconds": round(time.time() - start, 1),
            }
        )
        if (step + 1) % args.save_every == 0 or step == args.steps - 1:
            metadata = {
                "lora_rank": args.rank,
                "lora_alpha": args.alpha,
                "scenes_version": scenes.VERSION,
                "align_steps": done_before + step + 1,
                "vision_steps": args.vision_steps,
                "seed": args.seed,
            }
            assemble.save_trained(
                args.out / "testbed.safetensors", model, lora.state(model.model.language_model), metadata
            )


def plot_curves(logs: list[Path], path: Path) -> Path:
    """Loss per step of each stage (and the align stage's answer-token accuracy), from ``log.jsonl`` files."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = [json.loads(line) for log_file in logs for line in log_file.read_text().splitlines()]
    fig = Figure(figsize=(10, 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    for ax, stage, key in (
        (axes[0], "vision", "loss"),
        (axes[1], "align", "loss"),
        (axes[2], "align", "token_accuracy"),
    ):
        rows = [r for r in records if r.get("stage") == stage and key in r]
        ax.plot(range(len(rows)), [r[key] for r in rows], linewidth=1)
        ax.set_title(f"{stage}: {key.replace('_', ' ')}", fontsize=9)
        ax.set_xlabel("logged step (in run order)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--stage",
        choices=("vision", "align", "plot"),
        required=True,
        help="plot: draw <out>/log*.jsonl as <out>/curves.png",
    )
    parser.add_argument("--scenes", type=int, default=4000)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--questions", type=int, default=12, help="align: questions packed per image")
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument(
        "--tower-lr-scale", type=float, default=0.3, help="align: the tower's learning rate factor"
    )
    parser.add_argument(
        "--projector-lr-scale",
        type=float,
        default=1.0,
        help="align: the projector's learning rate factor (below 1 keeps stage 1's words)",
    )
    parser.add_argument(
        "--init",
        type=Path,
        help="vision: continue from this stage-1 state (a vision.pt, or a trained file's tower, projector)",
    )
    parser.add_argument(
        "--word-contrast", type=float, default=0.0, help="vision: the weight of word_contrast's loss"
    )
    parser.add_argument("--resume", type=Path, help="align: start from this testbed.safetensors")
    parser.add_argument(
        "--adapter",
        type=Path,
        help="align: start the LoRA from this testbed.safetensors (tower and projector from vision.pt)",
    )
    parser.add_argument(
        "--scene-share", type=float, default=0.5, help="the fraction of each batch drawn from the scenes"
    )
    parser.add_argument("--vision-steps", type=int, default=0, help="recorded in the metadata")
    args = parser.parse_args(argv)
    if not 0 <= args.scene_share <= 1:
        parser.error("--scene-share is a fraction of the batch: give a number from 0 to 1")
    if args.resume is not None and args.adapter is not None:
        parser.error("--resume already restores the adapter: give --resume or --adapter, not both")
    if args.stage == "plot":
        print(plot_curves(sorted(args.out.glob("log*.jsonl")), args.out / "curves.png"))
        return
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "log.jsonl").open("a")

    def log(record: dict) -> None:
        print(json.dumps(record), flush=True)
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    log({"args": {k: str(v) for k, v in vars(args).items()}, "scenes_version": scenes.VERSION})
    from priortr.testbed.assemble import image_processor

    pool_file = args.out / "pool.pt"
    if pool_file.exists():
        pool = torch.load(pool_file)
    else:
        pool = build_pool(args.scenes, image_processor())
        torch.save(pool, pool_file)
    log({"pool_images": pool["pixel_values"].shape[0]})
    if args.stage == "vision":
        state = train_vision(pool, args, log)
        torch.save(state, args.out / "vision.pt")
    else:
        train_align(pool, torch.load(args.out / "vision.pt"), args, log)


if __name__ == "__main__":
    main()
