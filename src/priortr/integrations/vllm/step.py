"""The pruned step: a vLLM step holding pruned prompts, from what ``embed_input_ids`` saw to the hidden
states the model returns. Planned on the host once, then layers 0..L on each pruned prompt whole, the
library's method's choice at layer L, and the step's batch through every layer with the kept keys and
values. ``models.py`` holds vLLM's hooks; they hand a step here once (``run_step``).

L is the deepest layer the model's settings score: a one-layer method's, or the last stage of a
multi-stage method (CLSE, PyramidDrop, ``stages``), whose earlier stages each cut the prompt on the way
(``prefill_prompt``), as ``priortr.apply``'s cuts compact its cache, so that after layer L every layer
holds the same survivors.

A step mixes requests: decodes, unpruned prefills, and pruned prefills whose scheduled rows are text +
K placeholders per image (K: what the image keeps after its last stage). For a pruned request the
full prompt (text + N tokens per image) runs through layers 0..L once, as one causal sequence outside
the paged cache; each scored layer's queries, keys and output go through the engine's front door
(``priortr.engine.front_door.StagedPrompt``), which plans the prompt with the library's own
constructor and runs the stage core ``priortr.apply`` runs (the same evidence, selection, checks and
cut). What survives is the prompt's text and the kept visual tokens, exactly as many as the
scheduled rows: their keys/values of layers 0..L, their hidden state after layer L and their original
positions. Text inside an image's layout (Mistral 3's row breaks) is scheduled right after the image's
K slots (``request_records.shrink_prompt``) and put back between the image's rows in the full prompt,
where the library scores and keeps it as text.

The batch (``run_step``): layers 0..L run on the rows vLLM computes (everything but the pruned
prompts) while the pruned prompts' kept keys/values enter the paged cache through vLLM's attention
layers, then layers L+1.. run on every row, the pruned prompts' rows holding their kept tokens at their
original positions. A step's model inputs may be longer than the tokens it embedded: vLLM's GPU runners
embed the scheduled ids, then hand the model the buffer padded to a CUDA-graph size (Model Runner V2:
``vllm/v1/worker/gpu/model_states/default.py:105,130``, vLLM 0.34; the V1 runner of 0.32/0.33:
``vllm/v1/worker/gpu_model_runner.py:3320-3331``, 0.33). The padding rows follow every request's rows;
they run with the rows vLLM computes, as rows of no request (vLLM's attention computes and caches the
step's ``num_actual_tokens`` only), and the hidden states returned keep the padded length.

An image's encoder rows are [N, D * (1 + J)]: its N embeddings, then (Qwen3-VL's DeepStack, J > 0) the
features the language model adds to the outputs of decoder layers 0..J-1 at the image's tokens, as
vLLM's Qwen3-VL encoder packs them. They are added to all N tokens of the whole prompt: the engine
refuses a scored layer before J - 1 (as ``priortr.apply`` does), so every injection happens before the cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from priortr.adapters import FamilyAdapter
from priortr.engine.config import BEFORE_LLM, PruningConfig
from priortr.engine.front_door import ScoredLayerTensors, StagedPrompt
from priortr.integrations.vllm.decoder import LayerParts, TextModel, request_bounds, unpadded_rows
from priortr.integrations.vllm.pipeline import handed_on
from priortr.integrations.vllm.positions import FamilyLayout
from priortr.integrations.vllm.request_records import SlotRecord, break_rows


@dataclass(frozen=True)
class ServedModel:
    """What every pruned step of one served model reads, made once when the model loads: its pruning
    settings, the library's adapter for its family, its Hugging Face config, its family's layout, the
    image placeholder's token id and its language model split at the scored layer."""

    config: PruningConfig
    adapter: FamilyAdapter
    hf_config: Any
    layout: FamilyLayout
    image_token: int
    text: TextModel

    @property
    def scored(self) -> list[LayerParts]:
        """Layers 0..L, taken apart (layer 0 alone for a method that prunes before the language model,
        which reads the step's request bounds from it)."""
        return self.text.scored

    @property
    def before_llm(self) -> bool:
        """Whether the method prunes before the language model (``pre_llm.py`` serves its steps)."""
        return self.config.stage_layer == BEFORE_LLM


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
    """A pruned prompt's surviving tokens (prompt order) after the layers run so far: keys and values
    [P, .] of those layers, hidden state and residual [P, D], positions [3, P]; after layer L, its P
    scheduled tokens."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: torch.Tensor
    residual: torch.Tensor
    positions: torch.Tensor


@torch.no_grad()
def run_step(
    model: ServedModel,
    step: StepInputs,
    positions: torch.Tensor,
    inputs_embeds: torch.Tensor,
    injected: list[torch.Tensor],
) -> Any:
    """The hidden states [T, D] of a step holding pruned prompts (see the module docstring; on a pipeline
    stage before the last, vLLM's intermediate tensors and the rows' positions, ``pipeline.handed_on``).
    ``positions`` are vLLM's [3, T]; ``injected[i]`` is what the language model adds to layer i's output
    at the step's rows (Qwen3-VL's DeepStack features; empty otherwise)."""
    prompts = plan_step(model, step, positions)
    with unpadded_rows():
        kept = [prefill_prompt(model, prompt, inputs_embeds) for prompt in prompts]
    return _run_batch(model, prompts, kept, positions, inputs_embeds, injected)


def plan_step(model: ServedModel, step: StepInputs, positions: torch.Tensor) -> list[PrunedPrompt]:
    """The step's pruned prompts from a host copy of its positions [3, T] and its requests' bounds (query
    starts, sequence lengths, ``decoder.request_bounds``), each read back from its images' slot records
    (``request_records.SlotRecord``), laid out as the family's layout lays an image out: the one plan
    of a pruned step, whether its prompts run layers 0..L here or are shortened before layer 0
    (``pre_llm.py``)."""
    starts, seq_lens = request_bounds(model.scored[0])
    host = positions.tolist()  # [3][T]
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
        length = SlotRecord.decode(host, own[0].row, own[0].kept_count).prompt_length
        if seq_lens[request] != end - start or end - start < length:
            raise RuntimeError(
                "priortr: a pruned prompt was scheduled in pieces (a chunk or a prefix-cache hit), which "
                "the plug-in's scheduler (PruningScheduler) never does; is another --scheduler-cls set?"
            )
        prompt = _plan_prompt(model, step, host, range(start, start + length), own)
        prompts.append(prompt)
    return prompts


def _plan_prompt(
    model: ServedModel,
    step: StepInputs,
    positions: list[list[int]],
    scheduled: range,
    images: list[StepImage],
) -> PrunedPrompt:
    """One pruned request's full prompt, read back from its ``scheduled`` rows of the batch (its prompt's
    P rows) and their records; an image's row breaks (``FamilyLayout.breaks``) are the rows after its K
    slots.

    Images with no text between them (their slots back to back) are one run of visual tokens, which
    ``priortr.apply`` ranks as one item under one budget: ``counts`` holds one count per run, the sum of
    its images' slots."""
    token_ids: list[int] = []
    columns: list[torch.Tensor] = []
    text_columns: list[int] = []
    text_rows: list[int] = []
    placed: list[tuple[torch.Tensor, torch.Tensor]] = []
    counts: list[int] = []
    start, length, layout = scheduled.start, len(scheduled), model.layout
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
        token_ids += [model.image_token] * (n_tokens + len(breaks))
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
def prefill_prompt(model: ServedModel, prompt: PrunedPrompt, inputs_embeds: torch.Tensor) -> KeptPrompt:
    """Layers 0..L on the prompt outside the paged cache, the method's stages among them, and the
    surviving tokens.

    The whole prompt enters layer 0; after each layer a stage scores (``StagedPrompt.layers``: the
    one-layer methods' L, or every stage of CLSE, PyramidDrop, ``stages``), the method's choice cuts
    the prompt's tokens to its survivors: their hidden states, residuals and positions, and the keys
    and values of every layer run so far, as ``priortr.apply``'s cut compacts its cache. The layers
    after a stage run on its survivors alone (causal among them, at their original positions). After
    layer L (the deepest stage the model's settings score) the survivors are the P tokens the prompt
    was scheduled on."""
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
    staged = StagedPrompt(
        model.adapter,
        model.hf_config,
        model.config,
        prompt.token_ids,
        prompt.counts,
        positions=prompt.positions,
        device=device,
    )
    if staged.layers and staged.layers[-1] > len(model.scored) - 1:
        raise RuntimeError(
            f"priortr: the model's language model was split after layer {len(model.scored) - 1}, and a "
            f"stage of its settings scores layer {staged.layers[-1]}"
        )
    # [1, S, D] the input of layer 0, copied: it is layer 0's residual stream, which vLLM's fused
    # add-norm may update in place (its GPU kernels do; the CPU build's does not)
    embedded = hidden.clone()[None] if staged.reads_embeddings else None
    positions = prompt.positions.to(device)  # [3, S'] the current tokens' original positions
    rope_positions = model.layout.layer_positions(positions)
    residual = None
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for index, parts in enumerate(model.scored):
        normed, residual = parts.attention_input(hidden, residual)
        q, k, v = parts.project(normed, rope_positions)
        keys.append(k)
        values.append(v)
        hidden, residual = parts.output(parts.causal_attention(q, k, v), residual)
        if index < levels:
            hidden = hidden + injected[index]
        if index not in staged.layers:
            continue
        keep = _stage(model, staged, index, q, k, hidden + residual, rope_positions, embedded)
        if keep is not None:
            cut = cut_prompt(KeptPrompt(keys, values, hidden, residual, positions), keep)
            keys, values, hidden, residual, positions = (
                cut.keys,
                cut.values,
                cut.hidden,
                cut.residual,
                cut.positions,
            )
            rope_positions = model.layout.layer_positions(positions)
    if hidden.shape[0] != prompt.length:
        raise RuntimeError(
            f"priortr: the method kept {hidden.shape[0]} tokens (text and visual) of a prompt scheduled on "
            f"{prompt.length} rows; the processor's plan and the step's choice disagree"
        )
    return KeptPrompt(keys=keys, values=values, hidden=hidden, residual=residual, positions=positions)


def cut_prompt(prompt: KeptPrompt, keep: torch.Tensor) -> KeptPrompt:
    """A prompt's current tokens cut to the columns ``keep`` [S''] (a stage's survivors): their hidden
    states, residuals and positions, and the keys and values of every layer run so far, as
    ``priortr.apply``'s cut compacts the cache of layers 0..L_i at stage i."""
    return KeptPrompt(
        keys=[key.index_select(0, keep) for key in prompt.keys],
        values=[value.index_select(0, keep) for value in prompt.values],
        hidden=prompt.hidden.index_select(0, keep),
        residual=prompt.residual.index_select(0, keep),
        positions=prompt.positions.index_select(1, keep),
    )


def _stage(
    model: ServedModel,
    staged: StagedPrompt,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    output: torch.Tensor,
    rope_positions: torch.Tensor,
    embedded: torch.Tensor | None,
) -> torch.Tensor | None:
    """The columns [S''] of the prompt's current S' tokens that survive the stage scored at ``layer``
    (None: all), chosen by the model's method from layer ``layer``'s queries/keys (after RoPE) and
    output [S', D] through the engine's front door (``StagedPrompt.cut``: the stage core
    ``priortr.apply`` runs). A method that ranks by the next layer's attention (PyramidDrop) gets that
    layer's queries and keys on ``output``, its input, as ``priortr.apply`` computes them before the
    layer runs."""
    parts = model.text.layers[layer]
    if staged.reads_next_layer:
        parts = model.text.layers[layer + 1]
        normed, _ = parts.attention_input(output, None)
        q, k, _ = parts.project(normed, rope_positions)
    scored = ScoredLayerTensors(
        queries=parts.heads_view(q, parts.heads),  # [1, h, S', d]
        keys=parts.heads_view(k, parts.kv_heads),
        output=output[None],
        scaling=parts.scaling,
        heads=model.hf_config.get_text_config().num_attention_heads,  # H, all ranks' heads: a chunk's size
        gather=parts.every_head,  # each chunk's [1, h, r, S'] rows joined with every rank's: [1, H, r, S']
    )
    return staged.cut(layer, scored, embedded)


def _run_batch(
    model: ServedModel,
    prompts: list[PrunedPrompt],
    kept: list[KeptPrompt],
    positions: torch.Tensor,
    inputs_embeds: torch.Tensor,
    injected: list[torch.Tensor],
) -> Any:
    """The step's batch through every layer: layers 0..L on the rows vLLM computes (everything but
    the pruned prompts, ``injected[i]`` added to layer i's output) while the pruned prompts' kept
    keys/values enter the paged cache, then layers L+1.. on every row, the pruned prompts' rows
    holding their kept tokens."""
    device = inputs_embeds.device
    rows = inputs_embeds.shape[0]
    pruned_rows = [r for p in prompts for r in range(p.start, p.start + p.length)]
    taken = set(pruned_rows)
    pruned = torch.tensor(pruned_rows, dtype=torch.long, device=device)
    live = torch.tensor([r for r in range(rows) if r not in taken], dtype=torch.long, device=device)
    positions = positions.clone()
    rope = model.layout.layer_positions(positions)
    hidden = inputs_embeds.index_select(0, live)
    live_rope = rope.index_select(-1, live)
    residual = hidden
    for index, parts in enumerate(model.scored):
        key = torch.cat([p.keys[index] for p in kept])
        value = torch.cat([p.values[index] for p in kept])
        query = key.new_zeros(rows, parts.heads * parts.head_dim)
        key = key.new_empty(rows, key.shape[1]).index_copy_(0, pruned, key)
        value = value.new_empty(rows, value.shape[1]).index_copy_(0, pruned, value)
        if live.numel():
            normed, residual = parts.attention_input(hidden, residual if index else None)
            q, k, v = parts.project(normed, live_rope)
            query.index_copy_(0, live, q)
            key.index_copy_(0, live, k)
            value.index_copy_(0, live, v)
        attended = parts.paged_attention(query, key, value)
        if live.numel():
            hidden, residual = parts.output(attended.index_select(0, live), residual)
            if index < len(injected):
                hidden = hidden + injected[index].index_select(0, live)
    width = inputs_embeds.shape[1]
    all_hidden = hidden.new_empty(rows, width).index_copy_(0, live, hidden)
    all_residual = residual.new_empty(rows, width).index_copy_(0, live, residual)
    all_hidden.index_copy_(0, pruned, torch.cat([p.hidden for p in kept]))
    all_residual.index_copy_(0, pruned, torch.cat([p.residual for p in kept]))
    positions.index_copy_(1, pruned, torch.cat([p.positions for p in kept], dim=1).to(positions.dtype))
    output = model.text.finish(model.layout.layer_positions(positions), all_hidden, all_residual)
    return handed_on(output, positions)  # a stage before the last: the kept tokens' positions too
