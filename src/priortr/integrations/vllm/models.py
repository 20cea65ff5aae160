"""vLLM's hooks of a pruned model: what the plug-in changes in vLLM's multimodal model classes, and
the behaviours families share (``served_families.py`` puts them together per family).

A family's class is vLLM's own model class with four hooks. A model config without ``priortr``
settings gets vLLM's own class (``PruningModel.__new__`` builds that instead), so a stock model never
runs the plug-in's code. The hooks:

* ``embed_multimodal``: each pruned image's N encoder rows travel as K rows of N * D values (one row
  of N * D, expanded to K without a copy), so vLLM's encoder cache holds the whole image whatever K the
  prompt laid out for it (the cache is keyed by the image, not by the request, and K depends on the
  request), and vLLM hands the step K rows for the image's K placeholders; an unpruned image's rows
  stay as vLLM lays them out;
* ``embed_input_ids``: unpacks them; an unpruned image (or the part of it a step schedules) is merged
  as vLLM merges it. An image is the placeholders that take its embeddings (vLLM's ``is_multimodal``
  rows), as many rows as vLLM handed it: a pruned image's K slots are one run
  (``request_records.shrink_prompt``), joined to the next image's where no text stands between them
  (LLaVA-OneVision's chat template), an unpruned image's rows may be several runs (Mistral 3's rows);
  tokens of its placeholder range outside them (InternVL's ``<img>`` and ``</img>``, Mistral 3's row
  breaks) are text rows;
* ``get_mrope_input_positions``: a request's positions and decode offset (``positions.py``); the 1-D
  RoPE families (LLaVA, LLaVA-NeXT, LLaVA-OneVision, InternVL, Mistral 3) are given vLLM's per-request
  M-RoPE bookkeeping for this, their layers still get 1-D positions;
* ``forward``: a step with a pruned prompt is handed to the pruned step once (``step.run_step``); any
  other step is the stock forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from priortr.adapters import adapter_for_type
from priortr.engine.config import check_grids
from priortr.engine.front_door import last_stage
from priortr.integrations.vllm.decoder import TextModel
from priortr.integrations.vllm.pipeline import empty_tensors, handed_on, received_positions, sent_rows
from priortr.integrations.vllm.positions import FamilyLayout, ImageSlots, linear_positions, request_positions
from priortr.integrations.vllm.pre_llm import shorten_prompts
from priortr.integrations.vllm.request_records import (
    embedded_tokens,
    image_record,
    recorded_lengths,
    take_kept,
)
from priortr.integrations.vllm.settings import served_settings
from priortr.integrations.vllm.step import ServedModel, StepImage, StepInputs, run_step
from priortr.integrations.vllm.vision_evidence import TowerTaps


def image_runs(is_multimodal: torch.Tensor) -> list[tuple[int, int]]:
    """Host list of the maximal runs [start, end) of True in ``is_multimodal`` [T]."""
    flags = is_multimodal.tolist()
    runs, start = [], None
    for row, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = row
        elif not flag and start is not None:
            runs.append((start, row))
            start = None
    return runs


class PruningModel:
    """Mixin over a vLLM multimodal model class; see the module docstring."""

    layout: FamilyLayout
    """How the family lays out an image's tokens and positions (``positions.FamilyLayout``)."""
    stock: type
    """vLLM's own class, built instead for a model config without ``priortr`` settings."""

    def __new__(cls, *args: Any, vllm_config: Any = None, prefix: str = "", **kwargs: Any) -> Any:
        """vLLM's own class for a config without priortr settings; called without a config (copying,
        unpickling), a bare instance as ``object.__new__`` makes it."""
        if vllm_config is not None and served_settings(vllm_config.model_config.hf_config) is None:
            return cls.stock(vllm_config=vllm_config, prefix=prefix)
        return super().__new__(cls)

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        hf_config = vllm_config.model_config.hf_config
        config = served_settings(hf_config).config
        adapter = adapter_for_type(hf_config.model_type)
        if "grid" in config.method.needs:
            check_grids(config, adapter)  # as priortr.apply refuses a family without token grids
        self._step: StepInputs | None = None
        self._served = ServedModel(
            config=config,
            adapter=adapter,
            hf_config=hf_config,
            layout=self.layout,
            image_token=adapter.visual_token_ids(hf_config)["image"],
            # split after the deepest scored layer; at layer 0 for a method pruning before the language
            # model, whose step reads its requests' bounds there
            text=TextModel(self, max(last_stage(config, hf_config.get_text_config().num_hidden_layers), 0)),
        )
        self.make_empty_intermediate_tensors = empty_tensors(self.make_empty_intermediate_tensors)
        self._sent_positions = sent_rows(vllm_config)  # a later pipeline stage's; None on the first
        self._taps = TowerTaps.of(self, config, adapter.name)

    def embed_multimodal(self, **kwargs: object) -> Any:
        """vLLM's encoder outputs; a pruned request's images (vLLM batches only items with the same
        fields, and only theirs carry a record, ``request_records.ImageRecord``) packed as [K, N * D]
        each, one row of N * D expanded to the image's K placeholders (a view: no copy). Other images
        stay [N, D], which vLLM slices to the placeholders of each step: a prefix-cache hit or a chunk
        boundary may fall inside an unpruned image."""
        kept = take_kept(kwargs)  # K per image, a host tensor
        if kept is None or self._taps is None:
            embeddings = super().embed_multimodal(**kwargs)
        else:  # the tower's evidence rides after a pruned image's rows (vision_evidence.py)
            with self._taps.capturing() as captured:
                embeddings = super().embed_multimodal(**kwargs)
            embeddings = self._taps.pack(embeddings, captured)
        if kept is None:
            return embeddings
        return [image.reshape(1, -1).expand(int(k), -1) for image, k in zip(embeddings, kept, strict=True)]

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: Any = None,
        *,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._step = None
        if not multimodal_embeddings:
            return super().embed_input_ids(input_ids, multimodal_embeddings, is_multimodal=is_multimodal)
        width = self._encoder_width()
        images, runs = [], iter(image_runs(is_multimodal))
        row = end = 0
        for packed in multimodal_embeddings:  # a pruned request's image [K, N * W], else the step's [n, W]
            embeddings, evidence = (
                self._unpack(packed[0], width) if packed.shape[1] > width else (packed, None)
            )
            first, taken = None, 0
            while taken < packed.shape[0]:  # its rows in the step, across runs (Mistral 3's image rows)
                if row == end:
                    row, end = next(runs)
                first = row if first is None else first
                rows = min(packed.shape[0] - taken, end - row)
                row, taken = row + rows, taken + rows
            images.append(StepImage(first, taken, embeddings, evidence))
        if any(image.pruned for image in images):
            self._step = StepInputs(input_ids.tolist(), images)
        merged = [image.embeddings[: image.kept_count] for image in images]
        return super().embed_input_ids(input_ids, merged, is_multimodal=is_multimodal)

    def _unpack(self, row: torch.Tensor, width: int) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """A pruned image's encoder rows [N, W] and its tower evidence (None: none travels) from its
        packed row."""
        if self._taps is None:
            return row.view(-1, width), None
        return self._taps.unpack(row, width)

    def _encoder_width(self) -> int:
        """The width W of an image's encoder rows as ``embed_multimodal`` returns them: the text width."""
        return self._served.hf_config.get_text_config().hidden_size

    def _step_injections(self, rows: int) -> list[torch.Tensor]:
        """What the language model adds to the outputs of its first layers in this step, [T, D] per
        layer, taken from the model (Qwen3-VL's DeepStack); none by default."""
        return []

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: list
    ) -> tuple[torch.Tensor, int]:
        images = [self._slots(feature) for feature in mm_features if feature.modality == "image"]
        others = [feature for feature in mm_features if feature.modality != "image"]

        def full(prompt: list[int], starts: list[int]) -> tuple[torch.Tensor, int]:
            return self._full_positions(prompt, starts, mm_features, others)

        lengths = recorded_lengths(mm_features)
        prompt_length = None if lengths is None else lengths.prompt
        return request_positions(input_tokens, images, self._served.image_token, full, prompt_length)

    def _stock_positions(self, prompt: list[int], features: list) -> tuple[torch.Tensor, int]:
        """The stock class's M-RoPE positions (Qwen)."""
        return super().get_mrope_input_positions(prompt, features)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> Any:
        step, self._step = self._step, None
        positions = received_positions(intermediate_tensors, positions, self._sent_positions)
        if step is None:
            rope = self.layout.layer_positions(positions)
            output = super().forward(input_ids, rope, intermediate_tensors, inputs_embeds, **kwargs)
            return handed_on(output, positions)
        if inputs_embeds is None or inputs_embeds.shape[0] < len(step.input_ids):
            raise RuntimeError("priortr: the step's embeddings are fewer than the tokens embed_input_ids saw")
        if self._served.before_llm:  # the survivors take the prompt's rows, then vLLM's own forward
            shortened = shorten_prompts(self._served, self._taps, step, positions, inputs_embeds)
            rope = self.layout.layer_positions(shortened)
            output = super().forward(None, rope, intermediate_tensors, inputs_embeds, **kwargs)
            return handed_on(output, shortened)
        injected = self._step_injections(inputs_embeds.shape[0])
        return run_step(self._served, step, positions, inputs_embeds, injected)


class LinearPositions:
    """The 1-D RoPE families (LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision, InternVL, Mistral 3): given vLLM's
    per-request M-RoPE bookkeeping for a request's positions and decode offset; their layers still get
    1-D positions."""

    supports_mrope = True

    def _full_positions(
        self, prompt: list[int], starts: list[int], features: list, others: list
    ) -> tuple[torch.Tensor, int]:
        return linear_positions(prompt, starts)


class SizedImages:
    """Families whose image's N follows from the image (tiles, an AnyRes grid, Pixtral's native size):
    an unpruned image's embedded tokens are laid out whole; a pruned image keeps K of the N its pixels'
    fields give (``_image_grid``; the processor refuses a pruned request sending embeddings instead)."""

    def _image_tokens(self, data: Mapping[str, Any]) -> int:
        raise NotImplementedError

    def _image_grid(self, data: Mapping[str, Any]) -> tuple[int, int]:
        """(rows, columns) of an image's N tokens as the family lays them out; one row by default."""
        return 1, self._image_tokens(data)

    def _slots(self, feature: Any) -> ImageSlots:
        offset, laid_out = embedded_tokens(feature.mm_position)
        if image_record(feature) is None:  # an image of an unpruned request: all N laid out
            return ImageSlots(offset, laid_out, laid_out, (1, laid_out))
        grid = self._image_grid(feature.data)
        return ImageSlots(offset, laid_out, grid[0] * grid[1], grid, self.layout.breaks(grid))


class AnyResImages(SizedImages):
    """LLaVA-NeXT and LLaVA-OneVision: vLLM lays out an image as one run of N ``<image>`` placeholders,
    its base crop, then its AnyRes tile grid unpadded to the image's aspect ratio with a learned newline
    feature after every grid row, as the encoder packs them; the newline rows are visual tokens of the
    run, pruned like the others, as ``priortr.apply`` prunes them (``priortr.adapters.llava_next``),
    whose ``anyres_tokens`` gives N from the image's size (a CPU-kept field)."""

    def _image_tokens(self, data: Mapping[str, Any]) -> int:
        height, width = data["image_sizes"].data.tolist()
        return self._served.adapter.anyres_tokens(self.config, height, width)


class QwenPositions:
    """M-RoPE positions of Qwen2-VL / Qwen2.5-VL / Qwen3-VL / GLM-4.1V requests, from vLLM's own rule on
    the full prompt."""

    def _slots(self, feature: Any) -> ImageSlots:
        span = feature.mm_position
        grid = self._served.adapter.image_grid(self.config, feature.data["image_grid_thw"].data.tolist())
        return ImageSlots(span.offset, span.length, grid[0] * grid[1], grid)

    def _full_positions(
        self, prompt: list[int], starts: list[int], features: list, others: list
    ) -> tuple[torch.Tensor, int]:
        """vLLM's positions of ``prompt`` (every image whole), its images' placeholders moved to
        ``starts``; other items (videos) stay where they are, in a request that prunes nothing."""
        images = sorted((f for f in features if f.modality == "image"), key=lambda f: f.mm_position.offset)
        moved = [
            replace(f, mm_position=replace(f.mm_position, offset=start, length=self._slots(f).tokens))
            for f, start in zip(images, starts, strict=True)
        ]
        return self._stock_positions(prompt, [*moved, *others])
