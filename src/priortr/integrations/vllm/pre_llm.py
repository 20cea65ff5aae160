"""A step holding prompts pruned before the language model (VisionZip, PruMerge, VisPruner, DivPrune):
each pruned prompt's scheduled rows (text + K placeholders per image) rewritten to its surviving tokens,
then vLLM's own forward over the whole batch.

``priortr.apply`` runs such a method before decoder layer 0 on the prompt's input embeddings (text + N
per image) and what the vision tower showed, keeps K tokens per image (a merging method's survivors carry
merged embeddings) at their original positions, and runs every layer on the short sequence. Here the
same stage core runs through the engine's front door (``priortr.engine.front_door.kept_before_llm``) on
each pruned prompt laid out whole (``step.plan_step``: its N embeddings per image come from the
encoder cache, its text rows from the step), and its P survivors, in prompt order, take its P scheduled
rows: their embeddings in ``inputs_embeds`` and their original positions. No layer runs outside vLLM's
forward and nothing is written to the paged cache but by vLLM itself, so the encoder's N rows per image
are the only part of the whole prompt a step holds (``scheduler.py`` charges the step its P rows).
"""

from __future__ import annotations

import torch

from priortr.engine.front_door import kept_before_llm
from priortr.integrations.vllm.step import PrunedPrompt, ServedModel, StepImage, StepInputs, plan_step
from priortr.integrations.vllm.vision_evidence import TowerTaps


@torch.no_grad()
def shorten_prompts(
    model: ServedModel,
    taps: TowerTaps | None,
    step: StepInputs,
    positions: torch.Tensor,
    inputs_embeds: torch.Tensor,
) -> torch.Tensor:
    """The step's positions [3, T] with every pruned prompt's rows holding its survivors' original
    positions; their embeddings are written into ``inputs_embeds`` [T', D] (T' >= T, the runner's
    padded buffer). Both are the runner's own buffers, their rows rewritten in place, as the runner
    rewrites them every step: vLLM's compiled language model runs as piecewise CUDA graphs on a GPU,
    which read their inputs at the addresses they were captured with, the runner's buffers (a copy of
    the positions would leave the survivors at their placeholders' positions). The plan is made from
    a host copy first (``plan_step``), so no prompt reads rows another has rewritten."""
    prompts = plan_step(model, step, positions)
    for prompt in prompts:
        images = [image for image in step.images if prompt.start <= image.row < prompt.start + prompt.length]
        columns, embeddings = _survivors(model, taps, prompt, images, inputs_embeds)
        if columns.shape[0] != prompt.length:
            raise RuntimeError(
                f"priortr: kept {columns.shape[0]} tokens for a prompt of {prompt.length} slots"
            )
        rows = torch.arange(prompt.start, prompt.start + prompt.length, device=inputs_embeds.device)
        inputs_embeds.index_copy_(0, rows, embeddings.to(inputs_embeds.dtype))
        kept = prompt.positions.to(positions.device).index_select(1, columns.to(positions.device))
        positions.index_copy_(1, rows.to(positions.device), kept.to(positions.dtype))
    return positions


def _survivors(
    model: ServedModel,
    taps: TowerTaps | None,
    prompt: PrunedPrompt,
    images: list[StepImage],
    inputs_embeds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The surviving columns [P] of the whole prompt and their embeddings [P, D], chosen by the method
    from the prompt's input embeddings [S, D] (text rows from the step, each image's N from its encoder
    rows) and its images' tower evidence."""
    device = inputs_embeds.device
    width = inputs_embeds.shape[1]
    hidden = inputs_embeds.new_empty(len(prompt.token_ids), width)  # [S, D]
    hidden.index_copy_(
        0, prompt.text_columns.to(device), inputs_embeds.index_select(0, prompt.text_rows.to(device))
    )
    for columns, embeddings in prompt.images:
        hidden.index_copy_(0, columns.to(device), embeddings[:, :width].to(hidden.dtype))
    tower = None
    if taps is not None:
        if any(image.evidence is None for image in images):
            raise RuntimeError("priortr: a pruned image reached the step without its vision tower's evidence")
        tower = taps.evidence([image.evidence for image in images])
    return kept_before_llm(
        model.adapter, model.hf_config, model.config, prompt.token_ids, prompt.counts, hidden, tower
    )
