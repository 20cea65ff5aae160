"""LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE), InternVL and
Mistral 3 as vLLM serves them, pruning visual tokens after decoder layer L.

Each class is vLLM's own model class with four hooks. A model config without ``priortr`` settings
gets vLLM's own class (``PruningModel.__new__`` builds that instead), so a stock model never runs
the plug-in's code. The hooks:

* ``embed_multimodal``: each pruned image's N encoder rows travel as K rows of N * D values (one row
  of N * D, expanded to K without a copy), so vLLM's encoder cache holds the whole image whatever K the
  prompt laid out for it (the cache is keyed by the image, not by the request, and K depends on the
  request), and vLLM hands the step K rows for the image's K placeholders; an unpruned image's rows
  stay as vLLM lays them out;
* ``embed_input_ids``: unpacks them; an unpruned image (or the part of it a step schedules) is merged
  as vLLM merges it. An image is the placeholders that take its embeddings (vLLM's ``is_multimodal``
  rows), as many rows as vLLM handed it: a pruned image's K slots are one run
  (``request_layout.shrink_prompt``), joined to the next image's where no text stands between them
  (LLaVA-OneVision's chat template), an unpruned image's rows may be several runs (Mistral 3's rows);
  tokens of its placeholder range outside them (InternVL's ``<img>`` and ``</img>``, Mistral 3's row
  breaks) are text rows;
* ``get_mrope_input_positions``: a request's positions and decode offset (``positions.py``); the 1-D
  RoPE families (LLaVA, LLaVA-NeXT, LLaVA-OneVision, InternVL, Mistral 3) are given vLLM's per-request
  M-RoPE bookkeeping for this, their layers still get 1-D positions;
* ``forward``: a step with a pruned prompt runs layers 0..L of that prompt whole (``prefill_step.py``),
  writes the kept tokens' keys/values of layers 0..L into its paged cache through vLLM's attention
  layers while they run the rest of the batch, then runs layers L+1.. on the kept tokens at their
  original positions. Any other step is the stock forward. A step's model inputs may be longer than
  the tokens it embedded: vLLM's GPU runners embed the scheduled ids, then hand the model the buffer
  padded to a CUDA-graph size (Model Runner V2: ``vllm/v1/worker/gpu/model_states/default.py:105,130``,
  vLLM 0.34; the V1 runner of 0.32/0.33: ``vllm/v1/worker/gpu_model_runner.py:3320-3331``, 0.33). The
  padding rows follow every request's rows; they run with the rows vLLM computes, as rows of no request
  (vLLM's attention computes and caches the step's ``num_actual_tokens`` only), and the hidden states
  returned keep the padded length.

Qwen3-VL's DeepStack features ride in each image's encoder rows (vLLM packs them there); a pruned step
adds them to the outputs of the first decoder layers as vLLM's own forward does (``prefill_step.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from vllm.model_executor.models.interns1 import InternS1ForConditionalGeneration
from vllm.model_executor.models.llava import LlavaForConditionalGeneration
from vllm.model_executor.models.llava_next import LlavaNextForConditionalGeneration
from vllm.model_executor.models.llava_onevision import LlavaOnevisionForConditionalGeneration
from vllm.model_executor.models.mistral3 import Mistral3ForConditionalGeneration
from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from vllm.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration
from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration
from vllm.model_executor.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration
from vllm.model_executor.models.vision import get_num_selected_vision_tokens, get_vision_encoder_info

from priortr.adapters import adapter_for_type
from priortr.engine.config import BEFORE_LLM
from priortr.integrations.vllm.decoder import TextModel, batch_layout, unpadded_rows
from priortr.integrations.vllm.positions import (
    LINEAR_ROPE,
    LINEAR_ROPE_ROW_BREAKS,
    MROPE,
    FamilyLayout,
    ImageSlots,
    linear_positions,
    request_positions,
)
from priortr.integrations.vllm.pre_llm import shorten_prompts
from priortr.integrations.vllm.prefill_step import (
    KeptPrompt,
    PrunedPrompt,
    StepImage,
    StepInputs,
    plan_step,
    prefill_prompt,
)
from priortr.integrations.vllm.request_layout import (
    embedded_tokens,
    image_record,
    recorded_lengths,
    take_kept,
)
from priortr.integrations.vllm.settings import served_settings
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

    layout: FamilyLayout = MROPE
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
        self.priortr = served_settings(hf_config).config
        self._step: StepInputs | None = None
        self._hf_config = hf_config
        self._adapter = adapter_for_type(hf_config.model_type)
        self._image_token = self._adapter.visual_token_ids(hf_config)["image"]
        # issue 57 (pre-LLM methods): layer 0 stands for the step's batch layout when nothing is scored
        self._before_llm = self.priortr.stage_layer == BEFORE_LLM
        self._text = TextModel(self, 0 if self._before_llm else self.priortr.layer)
        self._taps = TowerTaps.of(self, self.priortr, self._adapter.name)

    def embed_multimodal(self, **kwargs: object) -> Any:
        """vLLM's encoder outputs; a pruned request's images (vLLM batches only items with the same
        fields, and only theirs carry a record, ``request_layout.ImageRecord``) packed as [K, N * D]
        each, one row of N * D expanded to the image's K placeholders (a view: no copy). Other images
        stay [N, D], which vLLM slices to the placeholders of each step: a prefix-cache hit or a chunk
        boundary may fall inside an unpruned image."""
        kept = take_kept(kwargs)  # K per image, a host tensor
        if kept is None or self._taps is None:
            embeddings = super().embed_multimodal(**kwargs)
        else:  # issue 57: the tower's evidence rides after a pruned image's rows (vision_evidence.py)
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
        packed row (issue 57)."""
        if self._taps is None:
            return row.view(-1, width), None
        return self._taps.unpack(row, width)

    def _encoder_width(self) -> int:
        """The width W of an image's encoder rows as ``embed_multimodal`` returns them: the text width."""
        return self._hf_config.get_text_config().hidden_size

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
        return request_positions(input_tokens, images, self._image_token, full, prompt_length)

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
        if step is None:
            layer_positions = self.layout.layer_positions(positions)
            return super().forward(input_ids, layer_positions, intermediate_tensors, inputs_embeds, **kwargs)
        if inputs_embeds is None or inputs_embeds.shape[0] < len(step.input_ids):
            raise RuntimeError("priortr: the step's embeddings are fewer than the tokens embed_input_ids saw")
        return self._pruned_forward(step, positions, inputs_embeds)

    @torch.no_grad()
    def _pruned_forward(self, step: StepInputs, positions: torch.Tensor, inputs_embeds: torch.Tensor) -> Any:
        """One step holding pruned prompts: see the module docstring."""
        if self._before_llm:  # issue 57: the survivors take the prompt's rows, then vLLM's own forward
            shortened = shorten_prompts(
                step,
                positions,
                inputs_embeds,
                self._text.scored[0],
                self.priortr,
                self._adapter,
                self._hf_config,
                self._image_token,
                self.layout,
                self._taps,
            )
            return super().forward(None, self.layout.layer_positions(shortened), None, inputs_embeds)
        injected = self._step_injections(inputs_embeds.shape[0])
        starts, seq_lens = batch_layout(self._text.scored[0])
        prompts = plan_step(step, positions.tolist(), starts, seq_lens, self._image_token, self.layout)
        with unpadded_rows():
            kept = [
                prefill_prompt(
                    prompt,
                    inputs_embeds,
                    self._text.scored,
                    self.priortr,
                    self._adapter,
                    self._hf_config,
                    self.layout,
                )
                for prompt in prompts
            ]
        return self._run_batch(prompts, kept, positions, inputs_embeds, injected)

    def _run_batch(
        self,
        prompts: list[PrunedPrompt],
        kept: list[KeptPrompt],
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor,
        injected: list[torch.Tensor],
    ) -> torch.Tensor:
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
        rope = self.layout.layer_positions(positions)
        hidden = inputs_embeds.index_select(0, live)
        live_rope = rope.index_select(-1, live)
        residual = hidden
        for index, parts in enumerate(self._text.scored):
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
        return self._text.finish(self.layout.layer_positions(positions), all_hidden, all_residual)


class LinearPositions:
    """The 1-D RoPE families (LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision, InternVL, Mistral 3): given vLLM's
    per-request M-RoPE bookkeeping for a request's positions and decode offset; their layers still get
    1-D positions."""

    supports_mrope = True
    layout = LINEAR_ROPE

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


class PruningLlava(LinearPositions, PruningModel, LlavaForConditionalGeneration):
    """vLLM's LLaVA-1.5 with priortr (1-D RoPE)."""

    stock = LlavaForConditionalGeneration

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        info = get_vision_encoder_info(config)
        size = info.get_image_size()
        self._tokens_per_image = get_num_selected_vision_tokens(
            info.get_num_image_tokens(image_width=size, image_height=size),
            config.vision_feature_select_strategy,
        )

    def _slots(self, feature: Any) -> ImageSlots:
        span = feature.mm_position
        return ImageSlots(span.offset, span.length, self._tokens_per_image, (1, self._tokens_per_image))


class PruningInternVL(LinearPositions, SizedImages, PruningModel, InternS1ForConditionalGeneration):
    """vLLM's InternVL in the Hugging Face format (``InternVLForConditionalGeneration``, which vLLM
    serves with its InternS1 class) with priortr (1-D RoPE, as LLaVA).

    vLLM lays out an image as ``<img> <IMG_CONTEXT> x N </img>``, one placeholder range whose
    ``is_embed`` mask marks the ``<IMG_CONTEXT>`` run of N = ``num_image_token`` tokens per tile (256
    for the released 448-px tiles), the crops and the thumbnail of one image in one run, as
    ``priortr.apply`` prunes it: one budget over the image's tiles, ``</img>`` its separator
    (``priortr.adapters.internvl``)."""

    stock = InternS1ForConditionalGeneration

    def _image_tokens(self, data: Mapping[str, Any]) -> int:
        return int(data["image_num_patches"].data) * self.num_image_token


class AnyResImages(SizedImages):
    """LLaVA-NeXT and LLaVA-OneVision: vLLM lays out an image as one run of N ``<image>`` placeholders,
    its base crop, then its AnyRes tile grid unpadded to the image's aspect ratio with a learned newline
    feature after every grid row, as the encoder packs them; the newline rows are visual tokens of the
    run, pruned like the others, as ``priortr.apply`` prunes them (``priortr.adapters.llava_next``),
    whose ``anyres_tokens`` gives N from the image's size (a CPU-kept field)."""

    def _image_tokens(self, data: Mapping[str, Any]) -> int:
        height, width = data["image_sizes"].data.tolist()
        return self._adapter.anyres_tokens(self.config, height, width)


class PruningLlavaNext(LinearPositions, AnyResImages, PruningModel, LlavaNextForConditionalGeneration):
    """vLLM's LLaVA-NeXT with priortr (1-D RoPE, as LLaVA; AnyRes as ``AnyResImages``)."""

    stock = LlavaNextForConditionalGeneration


class PruningLlavaOnevision(
    LinearPositions, AnyResImages, PruningModel, LlavaOnevisionForConditionalGeneration
):
    """vLLM's LLaVA-OneVision with priortr (1-D RoPE, as LLaVA; AnyRes as ``AnyResImages``, its tile
    grid downsampled above ``anyres_max_N``)."""

    stock = LlavaOnevisionForConditionalGeneration


class PruningMistral3(LinearPositions, SizedImages, PruningModel, Mistral3ForConditionalGeneration):
    """vLLM's Mistral 3 (Pixtral tower; Mistral Small 3.1 / 3.2) with priortr (1-D RoPE, as LLaVA).

    vLLM lays out an image of ``rows x cols`` tokens as ``PixtralProcessor`` writes it, ``[IMG] x cols``
    then ``[IMG_BREAK]`` per row, the last break replaced by ``[IMG_END]``: one placeholder range whose
    ``is_embed`` mask marks the ``[IMG]`` tokens. ``priortr.apply`` prunes the ``[IMG]`` tokens only, one
    budget per image, ``[IMG_END]`` its separator, the row breaks kept as text
    (``priortr.adapters.mistral3``); so does the plug-in (``LINEAR_ROPE_ROW_BREAKS``). The grid comes
    from the image's pixels, which vLLM's processor crops to the image's resized size, a whole number of
    tokens on each side (``Mistral3Adapter.image_grid``)."""

    stock = Mistral3ForConditionalGeneration
    layout = LINEAR_ROPE_ROW_BREAKS

    def _image_grid(self, data: Mapping[str, Any]) -> tuple[int, int]:
        height, width = data["pixel_values"].data.shape[-2:]
        return self._adapter.image_grid(self.config, int(height), int(width))


class QwenPositions:
    """M-RoPE positions of Qwen2-VL / Qwen2.5-VL requests, from vLLM's own rule on the full prompt."""

    layout = MROPE

    def _slots(self, feature: Any) -> ImageSlots:
        span = feature.mm_position
        grid = self._adapter.image_grid(self.config, feature.data["image_grid_thw"].data.tolist())
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


class PruningQwen2VL(QwenPositions, PruningModel, Qwen2VLForConditionalGeneration):
    """vLLM's Qwen2-VL with priortr (M-RoPE)."""

    stock = Qwen2VLForConditionalGeneration


class PruningQwen2_5_VL(QwenPositions, PruningModel, Qwen2_5_VLForConditionalGeneration):
    """vLLM's Qwen2.5-VL with priortr (M-RoPE)."""

    stock = Qwen2_5_VLForConditionalGeneration


class PruningQwen3VL(QwenPositions, PruningModel, Qwen3VLForConditionalGeneration):
    """vLLM's Qwen3-VL with priortr (interleaved M-RoPE, q/k norms, DeepStack).

    vLLM's encoder returns each image's rows as [N, D * (1 + J)], its embeddings and J DeepStack
    features, and ``embed_input_ids`` leaves the features of the step's tokens in a buffer that the
    forward adds to the outputs of decoder layers 0..J-1; a pruned step takes them from that buffer."""

    stock = Qwen3VLForConditionalGeneration

    def _encoder_width(self) -> int:
        return super()._encoder_width() * (1 + self.deepstack_num_level)

    def _step_injections(self, rows: int) -> list[torch.Tensor]:
        found = self._get_deepstack_input_embeds(rows)  # views of the buffer, cleared below
        if found is None:
            return []
        injected = [
            found[f"deepstack_input_embeds_{level}"].clone() for level in range(self.deepstack_num_level)
        ]
        self._clear_deepstack_input_embeds(rows)
        return injected


class PruningQwen3VLMoe(PruningQwen3VL, Qwen3VLMoeForConditionalGeneration):
    """vLLM's Qwen3-VL MoE (Qwen3-VL-30B-A3B, 235B-A22B) with priortr: Qwen3-VL's vision side,
    positions and DeepStack as ``PruningQwen3VL``, a language model whose decoder layers' MLPs are
    vLLM's sparse MoE blocks (``decoder.py``). Under tensor, data or expert parallelism its MoE blocks
    exchange rows across ranks, which the plug-in has not checked: ``config_hooks`` refuses them."""

    stock = Qwen3VLMoeForConditionalGeneration
