"""Train the testbed's vision tower, projector and LoRA adapter (``python -m priortr.testbed.train``).

Two stages, because a forward and backward pass through SmolLM2 costs ~1.6 s per 576-token sample on
the 2-core CPU (bfloat16) and no accelerator was available:

1. ``vision``: the CLIP tower alone learns, per patch, the colour, shape, size, side and letter of the
   object under it (dense labels from the scene generator; shape and colour masks for easy-VQA). Cheap:
   no language model.
2. ``align``: the projector and a rank-8 LoRA on SmolLM2's attention projections (and the tower, at a
   lower learning rate) learn to answer, end to end through the stock ``LlavaForConditionalGeneration``,
   with every question of an image packed as one multi-turn conversation (one image encoding and one
   576-token prefix serve several questions).

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
EASY_COLOURS = ("red", "green", "blue", "black", "gray", "teal", "brown", "yellow")
SHAPE_LABELS = ("none", *scenes.SHAPES, "rectangle")
COLOUR_LABELS = ("none", *dict.fromkeys((*scenes.COLOURS, *EASY_COLOURS)))
SIZE_LABELS = ("none", "small", "large")
SIDE_LABELS = ("none", "left", "right")
LETTER_LABELS = ("none", *sorted(scenes.LETTERS))
HEADS = {
    "colour": COLOUR_LABELS,
    "shape": SHAPE_LABELS,
    "size": SIZE_LABELS,
    "side": SIDE_LABELS,
    "letter": LETTER_LABELS,
}
IGNORE = -100


def pixel_values(images, processor) -> torch.Tensor:
    return processor(images=images, return_tensors="pt")["pixel_values"]


def _patch_cover(mask) -> torch.Tensor:
    pixels = (
        torch.frombuffer(bytearray(mask.tobytes()), dtype=torch.uint8).float().view(IMAGE_SIZE, IMAGE_SIZE)
    )
    return F.avg_pool2d(pixels[None, None] / 255, PATCH_SIZE).flatten()


def scene_labels(scene: scenes.Scene) -> dict[str, torch.Tensor]:
    """Per-patch labels of the object covering the most of a patch (at least 15%). Only ``size`` and
    ``side`` label background patches ("none"): the attribute heads learn from object patches alone, so
    that the few patches of a small object are not outweighed by the background. A large shape's colour
    is not labelled (its stripes make it two colours; no question asks it)."""
    labels = {name: torch.full((GRID * GRID,), IGNORE, dtype=torch.long) for name in HEADS}
    labels["size"].zero_()
    labels["side"].zero_()
    cover = torch.stack([_patch_cover(scenes.thing_mask(t)) for t in scene.things])
    best, owner = cover.max(0)
    for patch in torch.nonzero(best >= 0.15).flatten().tolist():
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


def easy_vqa_attributes(samples: list[data.Sample]) -> tuple[str | None, str | None]:
    """The image's shape and colour, read back from its questions' answers."""
    shape = colour = None
    for s in samples:
        words = s.question.rstrip("?").split()
        if s.answer in EASY_SHAPES:
            shape = s.answer
        elif s.answer in EASY_COLOURS:
            colour = s.answer
        elif s.answer == "yes" and "not" not in words:
            shape = next((w for w in words if w in EASY_SHAPES), shape)
            colour = next((w for w in words if w in EASY_COLOURS), colour)
        for w in words:
            if w in EASY_COLOURS and s.answer in EASY_SHAPES:
                colour = w
            if w in EASY_SHAPES and s.answer in EASY_COLOURS:
                shape = w
    return shape, colour


def easy_vqa_labels(image, samples: list[data.Sample]) -> dict[str, torch.Tensor]:
    """The shape's patches (pixels far from the background colour) carry its shape and colour."""
    big = image.resize((IMAGE_SIZE, IMAGE_SIZE))
    pixels = (
        torch.frombuffer(bytearray(big.tobytes()), dtype=torch.uint8).float().view(IMAGE_SIZE, IMAGE_SIZE, 3)
    )
    far = (pixels - pixels[0, 0]).abs().sum(-1) > 60
    cover = F.avg_pool2d(far[None, None].float(), PATCH_SIZE).flatten()
    shape, colour = easy_vqa_attributes(samples)
    on = cover >= 0.15
    labels = {name: torch.full((GRID * GRID,), IGNORE, dtype=torch.long) for name in HEADS}
    for name, value, table in (("shape", shape, SHAPE_LABELS), ("colour", colour, COLOUR_LABELS)):
        if value is not None:
            labels[name] = torch.where(on, table.index(value), IGNORE)
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
        labels.append(easy_vqa_labels(image, samples))
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
        return {
            name: F.cross_entropy(head(features).flatten(0, 1), labels[name].flatten(), ignore_index=IGNORE)
            for name, head in self.heads.items()
        }


def train_vision(
    pool: dict, steps: int, batch: int, lr: float, log, init: Path | None = None
) -> CLIPVisionModel:
    tower = CLIPVisionModel(architecture.vision_config())
    if init is not None:
        tower.load_state_dict(torch.load(init))
    heads = DenseHeads(tower.config.hidden_size)
    params = [*tower.parameters(), *heads.parameters()]
    optimiser = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, lr, total_steps=steps, pct_start=0.05)
    n = pool["pixel_values"].shape[0]
    generator = torch.Generator().manual_seed(0)
    start = time.time()
    for step in range(steps):
        idx = torch.randint(n, (batch,), generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = tower(pool["pixel_values"][idx].float(), output_hidden_states=True)
            losses = heads(
                out.hidden_states[-1][:, 1:].float(), {k: v[idx] for k, v in pool["labels"].items()}
            )
        loss = sum(losses.values())
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        schedule.step()
        if step % 25 == 0 or step == steps - 1:
            log(
                {
                    "stage": "vision",
                    "step": step,
                    "loss": loss.item(),
                    "seconds": time.time() - start,
                    **{k: round(v.item(), 4) for k, v in losses.items()},
                }
            )
    return tower


def conversation(
    questions: list[tuple[str, str]], tokenizer, rng: random.Random, turns: int
) -> tuple[list[int], list[int]]:
    """Up to ``turns`` of an image's questions as one chat (the testbed's template); labels mark each
    answer and its end-of-turn token."""
    picked = rng.sample(questions, min(turns, len(questions)))
    ids: list[int] = []
    labels: list[int] = []
    for turn, (question, answer) in enumerate(picked):
        image = architecture.IMAGE_TOKEN * (GRID * GRID) + "\n" if turn == 0 else ""
        prompt = tokenizer(f"<|im_start|>user\n{image}{question}<|im_end|>\n<|im_start|>assistant\n")[
            "input_ids"
        ]
        reply = tokenizer(f"{answer}<|im_end|>\n")["input_ids"]
        ids += prompt + reply
        labels += [IGNORE] * len(prompt) + reply[:-1] + [IGNORE]
    return ids, labels


def align_model(vision_state: dict, rank: int, alpha: float):
    from priortr.testbed import assemble, lora

    language_model, tokenizer = assemble.smollm2()
    model = assemble.llava(language_model, tokenizer)
    model.model.vision_tower.load_state_dict(vision_state)
    model.requires_grad_(False)
    model.model.multi_modal_projector.requires_grad_(True)
    model.model.vision_tower.requires_grad_(True)
    adapters = lora.add(model.model.language_model, rank, alpha)
    return model, tokenizer, [*model.model.multi_modal_projector.parameters(), *adapters]


def align_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy on answer tokens, with the LM head applied only where a label is."""
    hidden = model.model(
        input_ids=batch["input_ids"],
        pixel_values=batch["pixel_values"],
        attention_mask=batch["attention_mask"],
    ).last_hidden_state
    targets = batch["labels"][:, 1:]
    where = targets != IGNORE
    logits = model.lm_head(hidden[:, :-1][where]).float()
    truth = targets[where]
    return F.cross_entropy(logits, truth), (logits.argmax(-1) == truth).float().mean()


def collate(items: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), pad_id)
    labels = torch.full((len(items), width), IGNORE)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (ids, labs) in enumerate(items):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(labs)] = torch.tensor(labs)
        mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def train_align(pool: dict, vision_state: dict, args, log) -> None:
    from priortr.testbed import assemble, lora

    model, tokenizer, params = align_model(vision_state, args.rank, args.alpha)
    tower = list(model.model.vision_tower.parameters())
    groups = [{"params": params, "lr": args.lr}, {"params": tower, "lr": args.lr * args.tower_lr_scale}]
    optimiser = torch.optim.AdamW(groups, weight_decay=0.0)
    peaks = [args.lr, args.lr * args.tower_lr_scale]
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, peaks, total_steps=args.steps, pct_start=0.05)
    params = params + tower
    rng = random.Random(args.seed)
    n_scenes = args.scenes
    n = pool["pixel_values"].shape[0]
    start = time.time()
    for step in range(args.steps):
        # Half scenes, half easy-VQA images.
        idx = [
            rng.randrange(n_scenes) if i % 2 == 0 else rng.randrange(n_scenes, n) for i in range(args.batch)
        ]
        batch = collate(
            [conversation(pool["questions"][i], tokenizer, rng, args.turns) for i in idx],
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
                "align_steps": step + 1,
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
    parser.add_argument("--scenes", type=int, default=6000)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument(
        "--tower-lr-scale", type=float, default=0.3, help="align: the tower's learning rate factor"
    )
    parser.add_argument("--init", type=Path, help="vision: continue from this tower state (a vision.pt)")
    parser.add_argument("--vision-steps", type=int, default=0, help="recorded in the metadata")
    args = parser.parse_args(argv)
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
        tower = train_vision(pool, args.steps, args.batch, args.lr, log, args.init)
        torch.save(tower.state_dict(), args.out / "vision.pt")
    else:
        train_align(pool, torch.load(args.out / "vision.pt"), args, log)


if __name__ == "__main__":
    main()
