"""A tiny LLaVA with LLaVA-1.5's 24 x 24 patch grid, and the vision-tower tensors the authors' code reads.

The pre-LLM baselines (PruMerge, PruMerge+, VisionZip, VisPruner, DivPrune) were written for CLIP
ViT-L/14-336 in LLaVA-1.5: 576 patch tokens plus [CLS], features from the penultimate layer
(``mm_vision_select_layer = -2``). Some of their code hard-codes that grid (PruMerge+'s
``torch.arange(0, 575, ...)``), so the model here keeps 576 patches (48 px images in 2 px patches)
and a 2-layer CLIP tower: layer 0 is the penultimate layer (the features), layer 1 the last.

``tower_tensors`` runs the stock tower once with eager attention and forward hooks, as the authors'
code does, and returns what each of them reads; ``pruned_run`` runs the model through the public API
and returns what the language model received.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlavaForConditionalGeneration

import priortr
from tests.helpers.tiny import Batch, llava_batch, tiny_llava

GRID = 24
N_VISUAL = GRID * GRID  # 576, as LLaVA-1.5


def tiny_llava_576(seed: int = 0) -> LlavaForConditionalGeneration:
    """A float64 LLaVA (4-layer Llama, 2-layer CLIP of width 32 and 2 heads) with 576 patch tokens."""
    return tiny_llava(
        attn="eager", seed=seed, image_size=2 * GRID, patch_size=2, text={"max_position_embeddings": 1024}
    )


def one_image(model: LlavaForConditionalGeneration, seed: int = 0) -> Batch:
    """One prompt with one image (the authors' code ranks one image at a time)."""
    return llava_batch(model, batch_size=1, seed=seed)


@dataclass(frozen=True)
class Tower:
    """The stock tower's tensors for one image, as the authors' hooks and outputs see them.

    ``q[i]`` / ``k[i]`` [T, C] are layer i's ``q_proj`` / ``k_proj`` outputs (all heads concatenated,
    before any scaling), T = 577 tokens with [CLS] first; ``hidden[i]`` [T, C] is
    ``hidden_states[i]`` (``hidden[0]`` the embeddings); ``attentions[i]`` [H, T, T] layer i's
    softmax; ``project`` maps pre-projector features [..., C] to language-model embeddings.
    """

    q: list[torch.Tensor]
    k: list[torch.Tensor]
    hidden: list[torch.Tensor]
    attentions: list[torch.Tensor]
    heads: int
    project: torch.nn.Module


def tower_tensors(model: LlavaForConditionalGeneration, batch: Batch) -> Tower:
    tower = model.model.vision_tower
    layers = getattr(tower, "vision_model", tower).encoder.layers
    q: dict[int, torch.Tensor] = {}
    k: dict[int, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(layers):
        attention = layer.self_attn
        hooks.append(attention.q_proj.register_forward_hook(lambda m, a, o, i=index: q.__setitem__(i, o)))
        hooks.append(attention.k_proj.register_forward_hook(lambda m, a, o, i=index: k.__setitem__(i, o)))
    try:
        with torch.no_grad():
            out = tower(batch.pixel_values, output_hidden_states=True, output_attentions=True)
    finally:
        for hook in hooks:
            hook.remove()
    return Tower(
        q=[q[i][0] for i in range(len(layers))],
        k=[k[i][0] for i in range(len(layers))],
        hidden=[h[0] for h in out.hidden_states],
        attentions=[a[0] for a in out.attentions],
        heads=model.config.vision_config.num_attention_heads,
        project=model.model.multi_modal_projector,
    )


@dataclass(frozen=True)
class Pruned:
    """What the public API kept: ``kept`` [K] indices into the image's 576 tokens (ascending) and
    ``embeddings`` [K, D] the language model's input at those tokens (after any merge)."""

    kept: torch.Tensor
    embeddings: torch.Tensor


def pruned_run(
    model: LlavaForConditionalGeneration, batch: Batch, method: str, budget: int, **options: object
) -> Pruned:
    """Run one prefill through ``priortr.apply`` and read the kept tokens and their input embeddings."""
    seen: dict[str, torch.Tensor] = {}
    norm = model.model.language_model.layers[0].input_layernorm
    hook = norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("hidden", a[0]))
    try:
        with priortr.apply(model, method=method, budget=budget, options=options) as handle, torch.no_grad():
            model(**batch.kwargs())
            result = handle.last
    finally:
        hook.remove()
    start = batch.image_start[0]
    kept = result.kept[0][result.kept[0] >= 0] - start
    columns = start + torch.arange(kept.numel())  # the text before the image keeps its columns
    return Pruned(kept=kept, embeddings=seen["hidden"][0, columns])


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of ``b``'s tokens that ``a`` also holds."""
    return len(set(a.tolist()) & set(b.tolist())) / max(1, b.numel())
