"""The vision tower's evidence for the methods that prune before the language model (VisionZip,
VisPruner, PruMerge), gathered inside ``embed_multimodal`` from vLLM's own tower, and carried with each
pruned image's rows through vLLM's encoder cache to the step that prunes it.

``priortr.apply`` hooks the tower's q/k projections and the projector's input while the tower runs
(``priortr.engine.hooks.vision_hooks``); ``TowerTaps`` hooks the same places of vLLM's tower: vLLM's CLIP
fuses the q/k/v projections into one ``qkv_proj`` (``vllm/model_executor/models/clip.py:382-388,416-417``
in vLLM 0.32), whose output is split as its ``forward`` splits it, and LLaVA's projector takes the
selected features of a batch of images at once (``vllm/model_executor/models/llava.py:640-647``). The
engine turns these raw tensors into the [CLS] attention and keys exactly as it does for ``apply``
(``priortr.engine.attention.cls_attention``), in the step, through the front door
(``priortr.engine.front_door.kept_before_llm``).

A pruned image travels as one row (``models.embed_multimodal`` expands it to its K placeholders): its N
encoder rows, each followed by that token's evidence (its features and keys, ``per_token`` values), then
the tower's own values (the [CLS] query and the keys of the tokens before the first visual one, ``fixed``
values), all in the tower's dtype, raw, so that nothing is rounded on the way. The row's length is
N * (W + per_token) + fixed, from which ``unpack`` reads N back.

vLLM builds LLaVA's tower only up to the feature layer (``init_vision_tower_for_llava``,
``vllm/model_executor/models/llava.py:425-443,455-465``), so the tower's last layer, which PruMerge ranks
by, exists only where it is the feature layer; elsewhere PruMerge is refused when the model loads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from priortr.engine.config import VISION_NEEDS, PruningConfig
from priortr.engine.front_door import TowerEvidence

_PROJECTIONS = {"vision": ("q", "k"), "vision_last": ("q_last", "k_last")}
"""The captures of each need that are read off a layer's fused q/k/v projection."""


def carried(needs: frozenset[str], width: int, first_token: int) -> tuple[int, int]:
    """The evidence values a pruned image carries for a method needing ``needs`` from a tower of
    ``width`` whose first visual token is ``first_token``: per visual token (its features, its keys of
    each tapped layer) and once (each tapped layer's [CLS] query and the keys before the first visual
    token)."""
    layers = len(needs & _PROJECTIONS.keys())
    return width * (int("features" in needs) + layers), width * (1 + first_token) * layers


def evidence_slots(config: PruningConfig, hf_config: Any) -> Callable[[int], int] | None:
    """Encoder-cache slots (rows of the language model's width) the evidence of a pruned image of N
    tokens takes beside its N rows, for ``config``'s method on a served model of ``hf_config``; None
    when nothing rides (``scheduler.py`` has the encoder cache count them)."""
    needs = config.method.needs & VISION_NEEDS
    if not needs:
        return None
    first = 1 if getattr(hf_config, "vision_feature_select_strategy", "default") == "default" else 0
    per_token, fixed = carried(needs, hf_config.vision_config.hidden_size, first)
    row = hf_config.get_text_config().hidden_size
    return lambda n_tokens: -(-(n_tokens * per_token + fixed) // row)


class TowerTaps:
    """Hooks on a served LLaVA model's CLIP tower, registered while ``capturing`` runs the encoder:
    the fused q/k/v projection of the feature layer (``vision``) and of the last layer (``vision_last``),
    and the projector's input (``features``), the captures ``priortr.apply`` takes."""

    def __init__(self, model: nn.Module, config: PruningConfig, family: str) -> None:
        needs = config.method.needs & VISION_NEEDS
        hf_config = model.config
        tower = getattr(model, "vision_tower", None)
        tower = getattr(tower, "vision_model", tower)
        feature_layer = getattr(hf_config, "vision_feature_layer", None)
        embeddings = getattr(tower, "embeddings", None)
        if not hasattr(embeddings, "class_embedding") or not isinstance(feature_layer, int):
            raise ValueError(
                f"{config.method.name} ranks by the vision tower's [CLS] attention, and this {family} "
                "model's vision tower has no [CLS] token; use a method that needs none (divprune, or a "
                "decoder-layer method)"
            )
        vision = hf_config.vision_config
        layers = tower.encoder.layers  # vLLM builds them up to the feature layer only
        index = feature_layer % (vision.num_hidden_layers + 1) - 1  # hidden_states[i]: layer i - 1's output
        if index < 0:
            raise ValueError(
                f"{config.method.name}: the feature layer is the tower's input; nothing to rank by"
            )
        if "vision_last" in needs and len(layers) < vision.num_hidden_layers:
            raise ValueError(
                f"{config.method.name} ranks by the [CLS] attention of the vision tower's last layer, "
                f"which vLLM does not build for this model: it builds {len(layers)} of the tower's "
                f"{vision.num_hidden_layers} layers, up to the feature layer ({feature_layer}); use "
                "visionzip, vispruner or divprune"
            )
        attention = layers[index].self_attn
        if attention.num_heads_per_partition != attention.num_heads:
            raise ValueError(
                f"{config.method.name} reads the vision tower's q/k projections, which tensor parallelism "
                "splits over ranks; serve it on one rank (--tensor-parallel-size 1)"
            )
        self.width = vision.hidden_size
        self.heads = vision.num_attention_heads
        self.scaling = float(attention.scale)
        self.first_token = 1 if hf_config.vision_feature_select_strategy == "default" else 0
        self.needs = needs
        self.names = [name for need in sorted(needs) for name in _PROJECTIONS.get(need, ())]
        self.features = "features" in needs
        self.project = model.multi_modal_projector
        self._captured: dict[str, torch.Tensor] = {}
        self._projections = [
            (module, suffix)
            for need, module, suffix in (
                ("vision", attention.qkv_proj, ""),
                ("vision_last", layers[-1].self_attn.qkv_proj, "_last"),
            )
            if need in needs
        ]

    @classmethod
    def of(cls, model: nn.Module, config: PruningConfig, family: str) -> TowerTaps | None:
        """The taps a served model needs for ``config``'s method; None when it reads nothing of the
        tower. Refuses (ValueError) a tower that does not show what the method reads."""
        if not config.method.needs & VISION_NEEDS:
            return None
        return cls(model, config, family)

    def _keep_projection(self, suffix: str) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            fused = output[0] if isinstance(output, tuple) else output  # [B, T, 3C]
            query, key, _ = fused.chunk(3, dim=-1)  # as CLIPAttention.forward splits it
            self._captured["q" + suffix] = query[:, :1]  # [B, 1, C]: the [CLS] row is all the engine reads
            self._captured["k" + suffix] = key  # [B, T, C]

        return hook

    def _keep_features(self, module: nn.Module, args: tuple) -> None:
        self._captured["features"] = args[0]  # [B, N, C]

    @contextmanager
    def capturing(self) -> Iterator[dict[str, torch.Tensor]]:
        """The captures of the encoder calls made inside the block (one batch of a pruned request's
        images): the hooks exist only while it runs, so an unpruned image's encoder call runs none."""
        self._captured = {}
        handles = [
            module.register_forward_hook(self._keep_projection(suffix))
            for module, suffix in self._projections
        ]
        if self.features:
            handles.append(self.project.register_forward_pre_hook(self._keep_features))
        try:
            yield self._captured
        finally:
            for handle in handles:
                handle.remove()
            self._captured = {}

    def pack(
        self, embeddings: Sequence[torch.Tensor], captured: dict[str, torch.Tensor]
    ) -> list[torch.Tensor]:
        """Each image's row [N * (W + per_token) + fixed] (module docstring) from its embeddings [N, W]
        and the batch's captures, one image per batch row, in order."""
        missing = [
            name for name in [*self.names, *(["features"] if self.features else [])] if name not in captured
        ]
        if missing:
            raise RuntimeError(f"priortr: the vision tower ran without showing {', '.join(missing)}")
        rows = []
        first = self.first_token
        for index, image in enumerate(embeddings):
            per_token = [image]
            fixed = []
            if self.features:
                per_token.append(captured["features"][index])  # [N, C]
            for name in self.names:
                value = captured[name][index]
                if name.startswith("k"):
                    per_token.append(value[first:])  # [N, C]
                    fixed.append(value[:first].reshape(-1))
                else:
                    fixed.append(value.reshape(-1))  # the [CLS] query [C]
            if any(part.dtype != image.dtype for part in [*per_token, *fixed]):
                raise RuntimeError("priortr: the vision tower's dtype differs from its embeddings'")
            rows.append(torch.cat([torch.cat(per_token, dim=1).reshape(-1), *fixed]))
        return rows

    @property
    def per_token(self) -> int:
        """Evidence values each visual token carries after its W embedding values."""
        return carried(self.needs, self.width, self.first_token)[0]

    @property
    def fixed(self) -> int:
        """Values an image carries once: the [CLS] queries and the keys before the first visual token."""
        return carried(self.needs, self.width, self.first_token)[1]

    def unpack(self, row: torch.Tensor, width: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """An image's embeddings [N, W] and its evidence (views of ``row``) from its packed row."""
        stride = width + self.per_token
        n_tokens, rest = divmod(row.numel() - self.fixed, stride)
        if rest:
            raise RuntimeError(f"priortr: an image row of {row.numel()} values is not {stride} per token")
        tokens = row[: n_tokens * stride].view(n_tokens, stride)
        evidence = {}
        column = width
        if self.features:
            evidence["features"] = tokens[:, column : column + self.width]
            column += self.width
        offset = n_tokens * stride
        for name in self.names:
            if name.startswith("k"):
                head = row[offset : offset + self.first_token * self.width].view(self.first_token, self.width)
                evidence[name] = torch.cat([head, tokens[:, column : column + self.width]])  # [T, C]
                column += self.width
                offset += self.first_token * self.width
            else:
                evidence[name] = row[offset : offset + self.width].view(1, self.width)  # [1, C]
                offset += self.width
        return tokens[:, :width], evidence

    def evidence(self, images: Sequence[dict[str, torch.Tensor]]) -> TowerEvidence:
        """A prompt's evidence for the front door, from its images' unpacked evidence in prompt order."""
        capture = {name: torch.stack([image[name] for image in images]) for name in images[0]}
        return TowerEvidence(capture, self.heads, self.scaling, self.first_token, self.width, self.project)
