"""A pruned prefill inside one vLLM step: plan it on the host, run layers 0..L on each pruned prompt
whole, score with the library's method, keep K tokens per image.

A step mixes requests: decodes, unpruned prefills, and pruned prefills whose scheduled rows are text +
K placeholders per image. For a pruned request the full prompt (text + N tokens per image) runs
through layers 0..L once, as one causal sequence outside the paged cache; layer L's queries, keys and
output go through the engine's front door (``priortr.engine.front_door.kept_columns``), which plans the
prompt with the library's own constructor and runs the stage core ``priortr.apply`` runs (the same
evidence, selection, checks and cut). What survives is the
prompt's text and the kept visual tokens, exactly as many as the scheduled rows: their keys/values of
layers 0..L, their hidden state after layer L and their original positions. Text inside an image's layout
(Mistral 3's row breaks) is scheduled right after the image's K slots (``request_layout.shrink_prompt``) and
put back between the image's rows in the full prompt, where the library scores and keeps it as text.

An image's encoder rows are [N, D * (1 + J)]: its N embeddings, then (Qwen3-VL's DeepStack, J > 0) the
features the language model adds to the outputs of decoder layers 0..J-1 at the image's tokens, as
vLLM's Qwen3-VL encoder packs them. They are added to all N tokens of the whole prompt: the engine
refuses a scored layer before J - 1 (as ``priortr.apply`` does), so every injection happens before the cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from priortr.adapters import FamilyAdapter
from priortr.engine.config import PruningConfig
from priortr.engine.front_door import ScoredLayerTensors, kept_columns
from priortr.integrations.vllm.decoder import LayerParts
from priortr.integrations.vllm.positions import FamilyLayout
from priortr.integrations.vllm.request_layout import SlotRecord, break_rows


@dataclass(frozen=True)
class StepImage:
    """An image scheduled in this step: the batch row of its first placeholder in the step, its
    placeholders in the step and its encoder rows [., D * (1 + J)] (the embeddings, then J DeepStack
    features; see above): a pruned image's N (K placeholders), an unpruned image's rows for its
    placeholders in the step. ``evidence``: what the vision tower showed of a pruned image, for a method
    that prunes before the language model and reads it (``vision_evidence.TowerTaps.unpack``)."""

    row: int
    kept_count: int
    embeddings: torch.Tensor
    evidence: dict[str, torch.Tensor] | None = None

    @property
    def pruned(self) -> bool:
        return self.kept_count < self.embeddings.shape[0]


@dataclass(frozen=True)
class StepInputs:
    """What ``embed_input_ids`` saw of this step, for the forward pass that follows it."""

    input_ids: list[int]
    images: list[StepImage]


@dataclass(frozen=True)
class PrunedPrompt:
    """One pruned request of the step, planned on the host.

    ``start``: the batch row of its first token; ``length``: its prompt's scheduled rows P (rows after
    them, in a re-prefill after preemption, are generated tokens run as usual); ``token_ids``,
    ``positions`` [3, S]: the full prompt (N tokens per image) and its positions; ``text_columns`` /
    ``text_rows``: its text tokens' indices in the full prompt and their batch rows; ``images``: each
    image's columns in the full prompt [N] and its embeddings; ``counts``: tokens each run of images
    keeps (an image, or images with no text between them: one item of ``priortr.apply``)."""

    start: int
    length: int
    token_ids: list[int]
    positions: torch.Tensor
    text_columns: torch.Tensor
    text_rows: torch.Tensor
    images: list[tuple[torch.Tensor, torch.Tensor]]
    counts: list[int]


@dataclass(frozen=True)
class KeptPrompt:
    """A pruned prompt after layer L, at its P surviving tokens (prompt order): keys and values [P, .]
    of layers 0..L, hidden state and residual [P, D], positions [3, P]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: torch.Tensor
    residual: torch.Tensor
    positions: torch.Tensor


def plan_step(
    step: StepInputs,
    positions: list[list[int]],
    starts: list[int],
    seq_lens: list[int],
    image_token: int,
    layout: FamilyLayout,
) -> list[PrunedPrompt]:
    """The step's pruned prompts from host copies of its positions [3][T] and request layout, each
    read back from its images' slot records (``request_layout.SlotRecord``), laid out as the family's
    ``layout`` lays an image out."""
    prompts = []
    images = iter(step.images)
    pending = next(images, None)
    for request, (start, end) in enumerate(pairwise(starts)):
        own = []
        while pending is not None and pending.row < end:
            own.append(pending)
            pending = next(images, None)
        if not any(image.pruned for image in own):
            continue
        length = SlotRecord.decode(positions, own[0].row, own[0].kept_count).prompt_length
        if seq_lens[request] != end - start or end - start < length:
            raise RuntimeError(
                "priortr: a pruned prompt was scheduled in pieces (a chunk or a prefix-cache hit), which "
                "the plug-in's scheduler (PruningScheduler) never does; is another --scheduler-cls set?"
            )
        prompt = _plan_prompt(step, positions, start, length, own, image_token, layout)
        prompts.append(prompt)
    return prompts


def _plan_prompt(
    step: StepInputs,
    positions: list[list[int]],
    start: int,
    length: int,
    images: list[StepImage],
    image_token: int,
    layout: FamilyLayout,
) -> PrunedPrompt:
    """One pruned request's full prompt of ``length`` tokens, read back from its scheduled rows and
    their records; an image's row breaks (``layout.breaks``) are the rows after its K slots.

    Images with no text between them (their slots back to back) are one run of visual tokens, which
    ``priortr.apply`` ranks as one item under one budget: ``counts`` holds one count per run, the sum of
    its images' slots."""
    token_ids: list[int] = []
    columns: list[torch.Tensor] = []
    text_columns: list[int] = []
    text_rows: list[int] = []
    placed: list[tuple[torch.Tensor, torch.Tensor]] = []
    counts: list[int] = []
    row = start
    for image in images:
        adjacent = bool(placed) and image.row == row  # right after the previous image's slots
        for r in range(row, image.row):
            text_columns.append(len(token_ids))
            text_rows.append(r)
            token_ids.append(step.input_ids[r])
        if adjacent:  # the position after the previous image's tokens (its slots hold records)
            base = int(columns[-1].max()) + 1
        else:
            base = positions[0][image.row - 1] + 1 if image.row > start else 0
        columns.append(
            torch.tensor([[p[r] for r in range(row, image.row)] for p in positions], dtype=torch.long)
        )
        record = SlotRecord.decode(positions, image.row, image.kept_count)
        grid, n_tokens = record.grid, image.embeddings.shape[0]
        if grid[0] * grid[1] != n_tokens or record.prompt_length != length:
            raise RuntimeError(
                f"priortr: an image's record says {grid} tokens in a prompt of {record.prompt_length}, "
                f"its encoder gave {n_tokens} in a prompt of {length}"
            )
        breaks = layout.breaks(grid)
        rows = break_rows(image.row, image.kept_count, len(breaks))
        first = len(token_ids)
        columns_of_breaks = [first + before + index for index, before in enumerate(breaks)]
        token_ids += [image_token] * (n_tokens + len(breaks))
        for column, r in zip(columns_of_breaks, rows, strict=True):
            token_ids[column] = step.input_ids[r]
            text_columns.append(column)
            text_rows.append(r)
        embedded = sorted(set(range(first, len(token_ids))) - set(columns_of_breaks))
        placed.append((torch.tensor(embedded, dtype=torch.long), image.embeddings))
        columns.append(layout.image_positions(base, grid))
        if adjacent:
            counts[-1] += image.kept_count
        else:
            counts.append(image.kept_count)
        row = rows.stop
    for r in range(row, start + length):
        text_columns.append(len(token_ids))
        text_rows.append(r)
        token_ids.append(step.input_ids[r])
    columns.append(
        torch.tensor([[p[r] for r in range(row, start + length)] for p in positions], dtype=torch.long)
    )
    return PrunedPrompt(
        start=start,
        length=length,
        token_ids=token_ids,
        positions=torch.cat(columns, dim=1),
        text_columns=torch.tensor(text_columns, dtype=torch.long),
        text_rows=torch.tensor(text_rows, dtype=torch.long),
        images=placed,
        counts=counts,
    )


@torch.no_grad()
def prefill_prompt(
    prompt: PrunedPrompt,
    inputs_embeds: torch.Tensor,
    layers: list[LayerParts],
    config: PruningConfig,
    adapter: FamilyAdapter,
    hf_config: object,
    layout: FamilyLayout,
) -> KeptPrompt:
    """Layers 0..L on the whole prompt, the method's choice at layer L, and the surviving tokens."""
    device = inputs_embeds.device
    length, width = len(prompt.token_ids), inputs_embeds.shape[1]
    hidden = inputs_embeds.new_empty(length, width)  # [S, D]
    hidden[prompt.text_columns.to(device)] = inputs_embeds[prompt.text_rows.to(device)]
    levels = prompt.images[0][1].shape[1] // width - 1  # J DeepStack features per token
    injected = inputs_embeds.new_zeros(levels, length, width)  # [J, S, D]: zero at text tokens
    for columns, embeddings in prompt.images:
        rows = embeddings.to(hidden.dtype)
        index = columns.to(device)
        hidden.index_copy_(0, index, rows[:, :width])
        if levels:
            injected.index_copy_(1, index, rows[:, width:].unflatten(1, (levels, width)).transpose(0, 1))
    positions = prompt.positions.to(device)  # [3, S]
    rope_positions = layout.layer_positions(positions)
    residual = None
    keys, values = [], []
    for index, parts in enumerate(layers):
        normed, residual = parts.attention_input(hidden, residual)
        q, k, v = parts.project(normed, rope_positions)
        keys.append(k)
        values.append(v)
        hidden, residual = parts.output(parts.causal_attention(q, k, v), residual)
        if index < levels:
            hidden = hidden + injected[index]
    keep = _survivors(prompt, q, k, hidden + residual, layers[-1], config, adapter, hf_config, len(layers))
    if keep.shape[0] != prompt.length:
        raise RuntimeError(f"priortr: kept {keep.shape[0]} tokens for a prompt of {prompt.length} slots")
    return KeptPrompt(
        keys=[k.index_select(0, keep) for k in keys],
        values=[v.index_select(0, keep) for v in values],
        hidden=hidden.index_select(0, keep),
        residual=residual.index_select(0, keep),
        positions=positions.index_select(1, keep),
    )


def _survivors(
    prompt: PrunedPrompt,
    q: torch.Tensor,
    k: torch.Tensor,
    output: torch.Tensor,
    parts: LayerParts,
    config: PruningConfig,
    adapter: FamilyAdapter,
    hf_config: object,
    n_scored: int,
) -> torch.Tensor:
    """The surviving columns [P] of the full prompt (its text and the kept visual tokens, ascending),
    chosen by ``config``'s method from layer L's queries/keys (after RoPE) and output through the
    engine's front door (``priortr.engine.front_door.kept_columns``: the stage core ``priortr.apply``
    runs)."""
    if config.layer != n_scored - 1:
        raise RuntimeError("priortr: the planned prompt lost its images or its scored layer")
    scored = ScoredLayerTensors(
        queries=parts.heads_view(q, parts.heads),  # [1, h, S, d]
        keys=parts.heads_view(k, parts.kv_heads),
        output=output[None],
        scaling=parts.scaling,
        heads=hf_config.get_text_config().num_attention_heads,  # H, all ranks' heads: a chunk's size
        gather=parts.every_head,  # each chunk's [1, h, r, S] rows joined with every rank's: [1, H, r, S]
    )
    return kept_columns(adapter, hf_config, config, prompt.token_ids, prompt.counts, scored)
