"""What the pruning engine needs to know about a model family, and nothing else.

An adapter declares where a family keeps its language model, its decoder layers and its attention
projections, which token ids mark visual tokens, and how the family writes position ids. The engine
owns every tensor operation; adding a family means a new adapter module, never an engine change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from priortr.tensors.gathers import gather_sequence
from priortr.tensors.rope import apply_rope


@dataclass(frozen=True)
class VisionProbe:
    """Where a family's vision tower exposes the evidence that pre-LLM methods rank and merge by.

    ``query_projection`` / ``key_projection`` belong to the self-attention of the vision layer whose
    output the model uses (the feature layer: VisionZip, VisPruner), ``last_query_projection`` /
    ``last_key_projection`` to the tower's last layer (PruMerge hooks ``layers[23]`` of CLIP-L);
    ``width`` is the tower's hidden size. ``projector`` maps the tower's features to the language
    model's embeddings; its input, the features before the projector, is captured for methods that
    compare or merge them there. ``first_token`` is the first vision-tower token that becomes a visual
    token of the language model (1 when the [CLS] token itself is dropped).
    """

    query_projection: nn.Module
    key_projection: nn.Module
    heads: int
    scaling: float
    first_token: int
    last_query_projection: nn.Module
    last_key_projection: nn.Module
    width: int
    projector: nn.Module


@dataclass(frozen=True)
class VisualItem:
    """One image (or video) of one prompt row, as the engine prunes it.

    ``positions`` [n] are the absolute prompt positions of the item's visual tokens, ascending; they
    need not be one run (Idefics3 interleaves sub-image markers). ``separator`` is the absolute
    position of the item's prior slot, the paper's "null" token right after it (Appendix A.3); it may
    equal the prompt length when the item ends the prompt (methods that need it then refuse).
    ``grid`` (h, w) lays the item's tokens out row-major on the image's token grid, set by
    ``FamilyAdapter.item_grids`` for methods that read it (CLSE); None otherwise.
    """

    row: int
    positions: torch.Tensor
    separator: int
    modality: str = "image"
    grid: tuple[int, int] | None = None

    @property
    def size(self) -> int:
        return int(self.positions.numel())


def visual_runs(input_ids: torch.Tensor, token_id: int) -> list[list[tuple[int, int]]]:
    """Per row, the maximal runs ``[start, end)`` of ``token_id`` in ``input_ids`` [B, S]."""
    is_token = (input_ids == token_id).int()
    edges = torch.diff(
        is_token,
        dim=1,
        prepend=is_token.new_zeros(is_token.shape[0], 1),
        append=is_token.new_zeros(is_token.shape[0], 1),
    )
    runs = []
    for row in range(input_ids.shape[0]):
        starts = (edges[row] == 1).nonzero().flatten().tolist()
        ends = (edges[row] == -1).nonzero().flatten().tolist()
        runs.append(list(zip(starts, ends, strict=True)))
    return runs


class FamilyAdapter:
    """Base adapter: the defaults fit a ``*ForConditionalGeneration`` whose ``.model`` holds a
    ``language_model`` with ``.layers``, each with ``self_attn.{q,k}_proj`` (LLaVA, Qwen-VL).

    For adding a new family, set or override (docs/how-it-works.md, "Adding a family", walks one):

    Required:
        ``name``, ``model_types``: the family's name and the ``config.model_type`` values it serves.
        ``visual_token_ids``: the placeholder token id of each modality (``image``, ``video``).

    Optional, where the family differs from the defaults:
        ``separator_token``: how the docs and errors name the token after an image (the prior's slot).
        ``multimodal_model``, ``language_model``, ``decoder_layers``: where the modules sit.
        ``attention``, ``query_projection``, ``key_projection``, ``scaling``, ``input_norm``,
        ``final_norm``: a decoder layer's parts.
        ``visual_items``: each image or video of a prompt row, when an item is not one run of its id.
        ``text_positions``, ``continuation_position_ids``: position ids that are not plain [B, S].
        ``queries_and_keys``: per-head queries and keys from the projections (q/k norms go here).
        ``rotate``, ``gather_rope``, ``inverse_rope``: RoPE that is not rotate-half (cos, sin) pairs.
        ``scales_queries``, ``query_scales``: queries scaled by their place in the sequence (Llama 4).
        ``attention_layers``: the decoder layers with softmax attention, when not every layer has it.
        ``scored_layers``, ``kv_shared_layers``: layers that attend over keys an earlier layer made
        (Gemma 4's KV sharing), which no method can score.
        ``injected_layers``: the leading layers that take visual features on their output (DeepStack).
        ``vision_probe``: the vision tower's [CLS] attention, for methods that rank by it.
        ``token_grids``, ``item_grids``: each image's token grid (h, w), for methods that filter on it or
        pool it; ``no_grid``: why a family has none.
        ``vision_modules``: the first and last modules of the image path, for timing it.
    """

    name: str = ""
    model_types: tuple[str, ...] = ()
    separator_token: str = "the first token after the image"

    def multimodal_model(self, model: nn.Module) -> nn.Module:
        """The module whose forward receives ``input_ids``, the masks and the cache (``model.model``)."""
        return model.model

    def language_model(self, model: nn.Module) -> nn.Module:
        return self.multimodal_model(model).language_model

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return self.language_model(model).layers

    def attention(self, layer: nn.Module) -> nn.Module:
        return layer.self_attn

    def query_projection(self, attention: nn.Module) -> nn.Module:
        return attention.q_proj

    def key_projection(self, attention: nn.Module) -> nn.Module:
        return attention.k_proj

    def scaling(self, attention: nn.Module) -> float:
        """The softmax scale of the attention's scores (``head_dim ** -0.5`` for LLaMA and Qwen)."""
        return attention.scaling

    def input_norm(self, layer: nn.Module) -> nn.Module:
        """The norm a decoder layer applies to its input before attention (pre-norm decoders)."""
        return layer.input_layernorm

    def final_norm(self, model: nn.Module) -> nn.Module:
        """The language model's norm after its last decoder layer, whose output the LM head reads."""
        return self.language_model(model).norm

    def visual_token_ids(self, config) -> dict[str, int]:
        """Token ids of visual placeholders, by modality name (``image``, ``video``)."""
        return {"image": config.image_token_id}

    def visual_items(self, config, input_ids: torch.Tensor) -> list[VisualItem]:
        """Every image or video of the batch, row by row in prompt order.

        The default makes each maximal run of one modality's placeholder id an item whose separator
        is the token right after the run; families whose items span several runs override this.
        """
        items = []
        for modality, token_id in self.visual_token_ids(config).items():
            for row, runs in enumerate(visual_runs(input_ids, token_id)):
                for start, end in runs:
                    positions = torch.arange(start, end, device=input_ids.device)
                    items.append(VisualItem(row, positions, end, modality))
        return sorted(items, key=lambda item: (item.row, int(item.positions[0])))

    token_grids: bool = False
    """Whether ``item_grids`` can lay an image's tokens out on a 2-D grid (h, w)."""
    no_grid: str = "its images are tiles or crops of several grids, or carry extra tokens"
    """Why a family without ``token_grids`` has none, for the refusal of a method that needs one."""

    def item_grids(
        self, model_config, items: list[VisualItem], arguments: Mapping[str, Any]
    ) -> list[VisualItem]:
        """``items`` with each image's token grid (``VisualItem.grid``), from the model's config and the
        arguments of its call (``arguments``: Qwen's ``image_grid_thw``). Raises ValueError naming what
        is missing where an item has no grid (a video, a family without ``token_grids``)."""
        raise ValueError(f"the {self.name} adapter defines no token grid for an image")

    def injected_layers(self, model: nn.Module) -> int:
        """How many leading decoder layers have visual features added to their output (DeepStack).

        Pruning must wait until the last injection: the earliest layer a stage may score is this
        count minus one, and methods that prune before the LLM are refused when it is not zero.
        """
        return 0

    def text_positions(self, model: nn.Module, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """The 1-D text positions ``[B or 1, S]`` inside whatever the family passes as position ids."""
        return position_ids

    def continuation_position_ids(self, model: nn.Module, text_positions: torch.Tensor) -> torch.Tensor:
        """Position ids to pass when continuing a pruned cache without any from the caller.

        The model would derive them from the cache length, which pruning shortened.
        """
        return text_positions

    def attention_layers(self, model: nn.Module) -> list[int]:
        """The decoder layers whose token mixer is softmax attention over the sequence (their q/k
        projections can be recomputed into attention rows); all of them unless a family mixes in other
        layers (Qwen3.5's linear attention), whose layers no method can score."""
        return list(range(len(self.decoder_layers(model))))

    def scored_layers(self, model: nn.Module) -> list[int]:
        """The attention layers a method can score: their own q/k projections make their attention rows
        (all of ``attention_layers`` unless some reuse an earlier layer's keys, ``kv_shared_layers``)."""
        return self.attention_layers(model)

    def kv_shared_layers(self, model: nn.Module) -> dict[int, str]:
        """The layers that attend over keys and values an earlier layer of the same forward stored (KV
        sharing), each with the key of the call's shared states it reads; none by default."""
        return {}

    def gather_rope(self, rope: tuple[torch.Tensor, ...], index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The position embeddings a decoder layer receives (``(cos, sin)``, each [B or 1, S, r]) at the
        positions ``index`` [B, S'] of its sequence."""
        return tuple(gather_sequence(part, index) for part in rope)

    def rotate(self, attention: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Queries or keys ``x`` [B, H, S, d] rotated as ``attention`` rotates them, by the position
        embeddings ``rope`` of those S tokens (rotate-half RoPE over the first ``r`` dimensions)."""
        cos, sin = rope
        return apply_rope(x, cos, sin)

    def inverse_rope(self, rope: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Position embeddings that undo ``rope`` (the rotation by the opposite angle)."""
        cos, sin = rope
        return cos, -sin

    def scales_queries(self, attention: nn.Module) -> bool:
        """Whether ``attention`` multiplies its queries by a factor of each query's index in the sequence
        (Llama 4's attention temperature), which ``query_scales`` gives."""
        return False

    def query_scales(self, attention: nn.Module, index: torch.Tensor) -> torch.Tensor:
        """The factors [B, S, 1] by which ``attention`` multiplies the queries at sequence index ``index``
        [B, S] (the unpruned prompt's columns, then one per later token), for layers that
        ``scales_queries``."""
        raise NotImplementedError(f"the {self.name or type(self).__name__} adapter scales no queries")

    def queries_and_keys(
        self, attention: nn.Module, query_out: torch.Tensor, key_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head queries [B, H, R, d] and keys [B, H_kv, S, d] from the projections' outputs (of R and
        S tokens), before RoPE. Families with q/k norms (Qwen3) apply them here."""
        head_dim = attention.head_dim
        queries = query_out.view(*query_out.shape[:2], -1, head_dim).transpose(1, 2)
        keys = key_out.view(*key_out.shape[:2], -1, head_dim).transpose(1, 2)
        return queries, keys

    def vision_probe(self, model: nn.Module) -> VisionProbe | None:
        """The [CLS] attention of the vision tower, or None when the family's tower has no [CLS] token."""
        return None

    def vision_modules(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """The first and last modules of the image path (vision tower, projector), for timing it."""
        multimodal = self.multimodal_model(model)
        return multimodal.vision_tower, multimodal.multi_modal_projector
