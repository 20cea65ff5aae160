"""The prompt vLLM schedules for a pruned request: K placeholders per image instead of N.

vLLM's processor lays out N placeholder tokens per image; the scheduler then reserves KV-cache slots
for every one. For a pruned request this processor keeps only the K the image will keep after the
scored layer (its share of the request's budget, planned by the library's own planner through the
engine's front door, ``priortr.engine.front_door.kept_runs``, which also refuses a prompt the method
cannot score, e.g. an image with no instruction after it), so the paged cache of every layer holds
text + K tokens per image. The N encoder rows still reach the model (``models.py`` packs them), which
computes layers 0..L on all of them once and keeps K. Tokens of an image's placeholder range that take
no embedding (vLLM's ``is_embed`` mask: InternVL's ``<img>`` and ``</img>``, Mistral 3's row breaks and
end marker) are text to the library and stay in the prompt (``request_records.shrink_prompt``). What the
request carries to the scheduler and the model (the short prompt, a record on each image) is written by
``request_records.py``, beside where it is read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from vllm.multimodal.inputs import MultiModalKwargsItem
from vllm.multimodal.parse import EmbeddingItems, MultiModalDataItems

from priortr.adapters import adapter_for_type
from priortr.engine.config import PruningConfig
from priortr.engine.front_door import kept_runs
from priortr.integrations.vllm.positions import FamilyLayout
from priortr.integrations.vllm.request_records import ImageRecord, embedded_tokens, shrink_prompt, with_record
from priortr.integrations.vllm.settings import (
    SETTINGS_KEY,
    STEP_LIMIT_KEY,
    WHOLE_LIMIT_KEY,
    check_request_kwargs,
    check_request_media,
    position_limit,
    request_config,
    served_settings,
)


class PruningProcessor:
    """Mixin for a vLLM multimodal processor: a pruned request's images get K placeholders each."""

    layout: FamilyLayout
    """How the family lays out an image (``positions.FamilyLayout``; its ``adjacent_images`` is read
    here), declared by each family's block (``served_families.py``)."""

    def _apply_hf_processor_main(self, mm_items: Any, hf_kwargs: Mapping[str, object]) -> Any:
        """The Hugging Face processor never sees the ``priortr`` request setting (InternVL's vLLM
        processor calls it here directly, not through ``_call_hf_processor``)."""
        hf_kwargs = {key: value for key, value in hf_kwargs.items() if key != SETTINGS_KEY}
        return super()._apply_hf_processor_main(mm_items, hf_kwargs)

    def get_dummy_inputs(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's profiling prompts (a bare image, nothing to score) with every token: the engine sizes
        its encoder cache and memory for unpruned requests, which a request may always ask for."""
        inputs = super().get_dummy_inputs(*args, **kwargs)
        if served_settings(self.info.get_hf_config()) is None:
            return inputs
        off = {**inputs.hf_processor_mm_kwargs, SETTINGS_KEY: {"enabled": False}}
        return replace(inputs, hf_processor_mm_kwargs=off)

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        """vLLM's processing, then the request's images cut to the placeholders they keep.

        vLLM keys its encoder cache (and checks each entry's embedding count against the request's
        placeholders) by an image's hash, while K depends on the request: the same image kept at two
        counts, in two requests or twice in one, would meet an entry of the wrong size and be dropped. So
        a pruned request is laid out first without vLLM's processor cache (which must see only what
        reaches the engine), and then processed again with each image identified as (image, N, the fields
        that fix its encoder output's shape, K, prompt length, unpruned length): the image carries both
        lengths, its K and N (``request_records.ImageRecord``). N and those fields are in the identity
        because a client's image ``uuid`` stands for the pixels and nothing else: two images of different
        sizes sent under one uuid, at the same K and prompt length, must not share an encoder output
        (vLLM's own reuse check compares the placeholder counts, K = K, and would let the second request
        meet the first image's N rows)."""
        hf_config = self.info.get_hf_config()
        served = served_settings(hf_config)
        if served is None:
            return super().apply(inputs, timing_ctx)
        policy = served.policy
        operator = self.info.ctx.model_config.multimodal_config  # the engine's --mm-processor-kwargs etc.
        check_request_kwargs(inputs.hf_processor_mm_kwargs, operator.mm_processor_kwargs or {}, policy)
        check_request_media(inputs.media_io_kwargs, operator.media_io_kwargs or {}, policy)
        config = request_config(served.config, inputs.hf_processor_mm_kwargs.get(SETTINGS_KEY), policy)
        if config is None:
            return super().apply(inputs, timing_ctx)
        check_pixels(inputs.mm_data_items)
        laid_out = super().apply(replace(inputs, cache=None), timing_ctx)  # N placeholders per image
        images = list(laid_out["mm_placeholders"].get("image", []))
        tokens = [embedded_tokens(span)[1] for span in images]  # N per image
        counts = image_counts(hf_config, config, laid_out, self.layout.adjacent_images)
        if counts == tokens:
            return super().apply(inputs, timing_ctx)
        unpruned = len(laid_out["prompt_token_ids"])
        length = unpruned - sum(tokens) + sum(counts)
        check_unpruned_length(unpruned, position_limit(self.info.ctx.model_config))
        check_step_limit(length, getattr(hf_config, STEP_LIMIT_KEY, None))
        check_whole_prompt_limit(unpruned, getattr(hf_config, WHOLE_LIMIT_KEY, None))
        identities = [
            f"{image_hash}:priortr-{n}-tokens-{encoder_shapes(item)}-kept-{kept}-prompt-{length}-of-{unpruned}"
            for image_hash, n, item, kept in zip(
                laid_out["mm_hashes"]["image"], tokens, laid_out["mm_kwargs"]["image"], counts, strict=True
            )
        ]
        keyed = replace(inputs, mm_uuid_items={**(inputs.mm_uuid_items or {}), "image": identities})
        out = super().apply(keyed, timing_ctx)
        placeholders = out["mm_placeholders"]
        prompt, ranges = shrink_prompt(out["prompt_token_ids"], placeholders["image"], counts)
        items = [
            with_record(item, ImageRecord(length, kept, encoded, unpruned))
            for item, kept, encoded in zip(out["mm_kwargs"]["image"], counts, tokens, strict=True)
        ]
        return {
            **out,
            "prompt_token_ids": prompt,
            "mm_placeholders": {**placeholders, "image": ranges},
            "mm_kwargs": type(out["mm_kwargs"])({**out["mm_kwargs"], "image": items}),
        }


def check_pixels(items: MultiModalDataItems) -> None:
    """Refuse a pruned request whose images come as embeddings (vLLM's ``--enable-mm-embeds``): the
    plug-in sizes an image's N from what its pixels carry (tile counts, image sizes, grids), which an
    embedding tensor does not, so the request is refused here, before it reaches the engine."""
    embedded = sorted(modality for modality, data in items.items() if isinstance(data, EmbeddingItems))
    if embedded:
        raise ValueError(
            f"priortr in vLLM prunes images sent as pixels and this request sends {', '.join(embedded)} "
            "embeddings; send the pixels, or send the request with "
            f'mm_processor_kwargs={{"{SETTINGS_KEY}": {{"enabled": false}}}}'
        )


def encoder_shapes(item: MultiModalKwargsItem) -> str:
    """What of an image's processed item, besides its pixels' values, fixes its encoder output's N and
    grid: every tensor field's shape and dtype, and a digest of the values of its integer fields (Qwen's
    ``image_grid_thw``, AnyRes ``image_sizes``, InternVL's ``image_num_patches``; Mistral 3's grid is its
    pixels' shape). A digest, not the values written out: a processor may hand integer pixels (Qwen3-VL's
    uint8 patches, 3.5 M values per 768 x 768 image), whose text took about 1 s a request."""
    parts = []
    for key in sorted(item):
        data = item[key].data
        if not isinstance(data, torch.Tensor):
            continue
        entry = f"{key}[{'x'.join(str(size) for size in data.shape)}]{data.dtype}"
        if not data.is_floating_point():
            values = data.detach().cpu().contiguous().numpy().tobytes()
            entry += "=" + hashlib.blake2b(values, digest_size=16).hexdigest()
        parts.append(entry)
    return ";".join(parts)


def check_unpruned_length(unpruned: int, limit: int) -> None:
    """Refuse a pruned prompt whose unpruned length (N placeholders per image) is more than the model
    places (``position_limit``): its tokens keep their original positions, so it needs every position
    its unpruned prompt has."""
    if unpruned > limit:
        raise ValueError(
            f"priortr keeps a pruned prompt at its original positions, and this prompt is {unpruned} "
            f"tokens unpruned where the model places {limit} (the larger of --max-model-len and the "
            "model's max_position_embeddings); shorten the prompt or send fewer or smaller images"
        )


def check_whole_prompt_limit(unpruned: int, limit: int | None) -> None:
    """Refuse a pruned prompt whose unpruned length (N placeholders per image) is more than one step
    runs of whole prompts (``limit``, None where no config hook ran): layers 0..L run on it whole, in
    one step, and vLLM budgets GPU memory from a start-up profile of ``limit`` tokens through every layer
    (vLLM 0.34's Model Runner V2: ``vllm/v1/worker/gpu/model_runner.py:238,1070-1091``; 0.33's V1 runner:
    ``vllm/v1/worker/gpu_model_runner.py:524``, ``:6133``), so a longer one would run
    where no memory was set aside for it. A smaller budget does not help: the whole prompt is N per
    image whatever K."""
    if limit is not None and unpruned > limit:
        raise ValueError(
            f"priortr runs a pruned prompt's first layers on the whole prompt in one engine step, and this "
            f"prompt is {unpruned} tokens unpruned where a step's memory was profiled for {limit} "
            "(--max-num-batched-tokens); raise --max-num-batched-tokens, send fewer or smaller images, or "
            f'send the request with mm_processor_kwargs={{"{SETTINGS_KEY}": {{"enabled": false}}}}'
        )


def check_step_limit(length: int, limit: int | None) -> None:
    """Refuse a pruned prompt of ``length`` tokens (K placeholders per image) that the engine cannot
    schedule in one step (``limit``, None where no config hook ran): its prefill is one step
    (``scheduler.py``), so it would wait forever."""
    if limit is not None and length > limit:
        raise ValueError(
            f"priortr prunes a prompt in one engine step, and this pruned prompt is {length} tokens where "
            f"a step holds {limit} (--max-num-batched-tokens, or a lower --long-prefill-token-threshold); "
            "raise --max-num-batched-tokens, ask for a smaller budget, or send the request with "
            f'mm_processor_kwargs={{"{SETTINGS_KEY}": {{"enabled": false}}}}'
        )


ADJACENT_REFUSED = (
    "this family's chat template never writes two images back to back, and the plug-in has not checked "
    "its positions for them against priortr.apply"
)
"""Why a family without ``FamilyLayout.adjacent_images`` refuses a pruned prompt with adjacent
images (Qwen2-VL / Qwen2.5-VL / Qwen3-VL, whose templates wrap every image in ``<|vision_start|>`` and
``<|vision_end|>``, and GLM-4.1V, whose processor wraps it in ``<|begin_of_image|>`` and
``<|end_of_image|>``; InternVL's and Mistral 3's placeholder ranges end in text, so theirs never meet)."""


def image_counts(hf_config: Any, config: PruningConfig, laid_out: Any, adjacent: bool) -> list[int]:
    """Tokens each image of a processed request (``laid_out``: N placeholders per image) keeps under
    ``config``, in vLLM's order of its images; refuses what the plug-in cannot prune. ``adjacent``:
    the family serves images with no text between them (``FamilyLayout.adjacent_images``)."""
    placeholders = laid_out["mm_placeholders"]
    images = list(placeholders.get("image", []))
    if not images:
        return []
    others = sorted(modality for modality, spans in placeholders.items() if spans and modality != "image")
    if others:
        raise ValueError(
            f"priortr in vLLM prunes images only and this request also holds {', '.join(others)}; "
            f'send it with mm_processor_kwargs={{"{SETTINGS_KEY}": {{"enabled": false}}}}'
        )
    spans = [embedded_tokens(span) for span in images]
    by_offset = sorted(range(len(images)), key=lambda i: spans[i][0])
    in_order = [0] * len(images)
    pending = iter(by_offset)
    adapter = adapter_for_type(hf_config.model_type)
    for start, size, kept in kept_runs(adapter, hf_config, config, laid_out["prompt_token_ids"]):
        run: list[int] = []
        for i in pending:
            run.append(i)
            if sum(spans[j][1] for j in run) >= size:
                break
        if not run or spans[run[0]][0] != start or sum(spans[j][1] for j in run) != size:
            raise ValueError(
                "priortr: the images vLLM laid out in this prompt are not the runs of image tokens "
                f'priortr.apply prunes; send it with mm_processor_kwargs={{"{SETTINGS_KEY}": '
                '{"enabled": false}}'
            )
        if len(run) > 1 and not adjacent:
            raise ValueError(
                f"priortr prunes images with no text between them as one run, and {ADJACENT_REFUSED}; "
                "put text between images"
            )
        for i, count in zip(run, split_run(kept, [spans[i][1] for i in run]), strict=True):
            in_order[i] = count
    if 0 in in_order:
        raise ValueError(
            "priortr: vLLM laid out an image that priortr.apply does not find in this prompt; send it "
            f'with mm_processor_kwargs={{"{SETTINGS_KEY}": {{"enabled": false}}}}'
        )
    return in_order


def split_run(kept: int, tokens: list[int]) -> list[int]:
    """Placeholders for each image of a run of adjacent images with ``tokens[i]`` tokens each, whose
    run keeps ``kept`` of them: every image 1 to its N (vLLM needs a placeholder to place an image),
    filled in order. Which image's slots hold which kept token does not matter: after layer L the slots
    hold the run's kept tokens in prompt order at their original positions (``step.py``)."""
    if kept < len(tokens):
        raise ValueError(
            f"priortr keeps {kept} tokens of a run of {len(tokens)} images with no text between them, and "
            "vLLM places each image on at least one token; ask for a larger budget, or put text between "
            "images"
        )
    counts = []
    for index, size in enumerate(tokens):
        count = min(size, kept - sum(counts) - (len(tokens) - index - 1))
        counts.append(count)
    return counts
