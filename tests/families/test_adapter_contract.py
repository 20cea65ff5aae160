"""The adapter contract, checked on every family: what the engine asks of a ``FamilyAdapter``, against
the stock transformers model (hooks on its own modules), so that a new family or a transformers change
breaks here first.

A new family adds its tiny model to ``tests.helpers.families.FAMILIES`` and one row to each table below;
what only one family does (AnyRes counts, DeepStack, M-RoPE ids, SmolVLM's runs) is tested in its own file.
"""

from __future__ import annotations

import pytest
import torch

from priortr import compat
from priortr.adapters import adapter_for
from priortr.adapters.base import FamilyAdapter
from priortr.adapters.gemma3 import Gemma3Adapter
from priortr.adapters.gemma4 import Gemma4Adapter
from priortr.adapters.glm4v import Glm4vAdapter
from priortr.adapters.glm46v import Glm46VAdapter
from priortr.adapters.idefics3 import Idefics3Adapter
from priortr.adapters.internvl import InternVLAdapter
from priortr.adapters.llama4 import Llama4Adapter
from priortr.adapters.llava import LlavaAdapter
from priortr.adapters.llava_next import LlavaNextAdapter, LlavaOnevisionAdapter
from priortr.adapters.llava_onevision1_5 import LlavaOnevision15Adapter
from priortr.adapters.minicpmv import MiniCPMV4_7Adapter, MiniCPMVAdapter
from priortr.adapters.mistral3 import Mistral3Adapter
from priortr.adapters.molmo2 import Molmo2Adapter
from priortr.adapters.qwen2_vl import QwenVLAdapter
from priortr.adapters.qwen3_5 import Qwen3_5Adapter
from priortr.adapters.qwen3_vl import Qwen3VLAdapter
from priortr.adapters.video_llava import VideoLlavaAdapter
from priortr.tools import families
from tests.helpers.families import FAMILIES
from tests.helpers.tiny import TEXT_LO

ADAPTERS: dict[str, type[FamilyAdapter]] = {
    "llava": LlavaAdapter,
    "qwen2.5-vl": QwenVLAdapter,
    "qwen2-vl": QwenVLAdapter,
    "llava-next": LlavaNextAdapter,
    "llava-onevision": LlavaOnevisionAdapter,
    "video-llava": VideoLlavaAdapter,
    "qwen3-vl": Qwen3VLAdapter,
    "qwen3-vl-moe": Qwen3VLAdapter,
    "internvl": InternVLAdapter,
    "smolvlm": Idefics3Adapter,
    "idefics3": Idefics3Adapter,
    "mistral3": Mistral3Adapter,
    "glm4v": Glm4vAdapter,
    "qwen3.5": Qwen3_5Adapter,
    "qwen3.5-moe": Qwen3_5Adapter,
    "gemma3": Gemma3Adapter,
    "llama4": Llama4Adapter,
    "llava-onevision-1.5": LlavaOnevision15Adapter,
    "glm46v": Glm46VAdapter,
    "glm46v-moe": Glm46VAdapter,
    "gemma4": Gemma4Adapter,
    "gemma4-e2b": Gemma4Adapter,
    "gemma4-moe": Gemma4Adapter,
    "minicpm-v-4.6": MiniCPMVAdapter,
    "minicpm-v-4.7": MiniCPMV4_7Adapter,
    "molmo2": Molmo2Adapter,
}
"""The adapter ``adapter_for`` must pick for each family."""

DUMMY_TOKENS = {
    "llava": 16,  # 4 x 4 patches
    "qwen2.5-vl": 576,  # 48 x 48 patches, 2 x 2 merge
    "qwen2-vl": 576,
    "llava-next": 88,  # base 16 + 8 x 8 tile patches + 8 newlines
    "llava-onevision": 46,
    "video-llava": 16,
    "qwen3-vl": 576,
    "qwen3-vl-moe": 576,
    "internvl": 7 * 16,  # 7 tiles of 16 tokens
    "smolvlm": 13 * 9,  # 3 x 4 sub-images and the global one, 9 tokens each
    "idefics3": 13 * 9,
    "mistral3": 6 * 6,  # the tiny tower's 48 px image_size: 6 x 6 tokens of 8 px
    "glm4v": 576,
    "qwen3.5": 576,
    "qwen3.5-moe": 576,
    "gemma3": 16,
    "llama4": 5 * 4,  # 2 x 2 tiles and the global view, 4 x 4 patches each, pixel-shuffled by 0.5
    "llava-onevision-1.5": 576,  # 48 x 48 patches, 2 x 2 merge
    "glm46v": 576,
    "glm46v-moe": 576,
    "gemma4": 14 * 20,  # the processor's default 280 tokens, each pooled from 2 x 2 patches
    "gemma4-e2b": 14 * 20,
    "gemma4-moe": 14 * 20,
    "minicpm-v-4.6": 5 * 16,  # the global view and 2 x 2 slices, 16 x 16 patches each, merged 16 to 1
    "minicpm-v-4.7": 5 * 16,
    "molmo2": 4 + 16,  # 2 x 2 low-resolution tokens, 4 x 4 from 2 x 2 crops
}
"""Visual tokens per row of ``families.dummy_inputs(adapter, config, 2, 8, ...)`` (the benchmark prompt)."""

FAMILY_NAMES = list(FAMILIES)

SEPARATOR_GAPS = {"molmo2": 2}
"""Tokens between an item's last visual token and its separator in the family's batch (Molmo2: the
``<im_col>`` and ``<im_end>`` after the last patch); none elsewhere."""


def test_every_family_has_a_row_in_every_table():
    assert list(ADAPTERS) == list(DUMMY_TOKENS) == FAMILY_NAMES


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_adapter_is_registered(models, family):
    assert type(adapter_for(models[family])) is ADAPTERS[family]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_visual_items_cover_the_visual_tokens_once(models, family):
    """Items are ascending runs of positions, in prompt order, disjoint, covering exactly the visual
    tokens of every row; each item's separator is the text token right after its last position (Molmo2's
    after the ``<im_end>`` closing the image, past the image-token block: ``SEPARATOR_GAPS``)."""
    model = models[family]
    batch = FAMILIES[family][1](model, 3)
    items = adapter_for(model).visual_items(model.config, batch.input_ids)
    visual = batch.visual_mask()
    covered = torch.zeros_like(visual)
    previous: dict[int, int] = {}
    for item in items:
        assert item.modality in ("image", "video")
        assert torch.all(item.positions[1:] > item.positions[:-1])
        assert int(item.positions[0]) > previous.get(item.row, -1)
        assert not covered[item.row, item.positions].any()
        covered[item.row, item.positions] = True
        previous[item.row] = int(item.positions[-1])
        gap = SEPARATOR_GAPS.get(family, 0)
        assert item.separator == int(item.positions[-1]) + 1 + gap and not visual[item.row, item.separator]
    assert torch.equal(covered, visual)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_accessors_are_the_modules_generate_runs(models, family):
    """Every decoder layer, the q/k projections of the layers a method can score and the multimodal model
    run once per ``generate()`` step; the vision modules run once, first before last (the images are
    encoded once)."""
    model = models[family]
    batch = FAMILIES[family][1](model, 2)  # first: the AnyRes builders ask the vision tower for counts
    adapter = adapter_for(model)
    layers = adapter.decoder_layers(model)
    assert len(layers) == model.config.text_config.num_hidden_layers
    first, last = adapter.vision_modules(model)
    watched = {"multimodal": adapter.multimodal_model(model), "vision first": first, "vision last": last}
    for i, layer in enumerate(layers):
        watched[f"layer{i}"] = layer
    for i in adapter.scored_layers(model):
        attention = adapter.attention(layers[i])
        watched[f"q{i}"] = adapter.query_projection(attention)
        watched[f"k{i}"] = adapter.key_projection(attention)
    ran: list[str] = []
    handles = [
        module.register_forward_hook(lambda m, a, out, name=name: ran.append(name))
        for name, module in watched.items()
    ]
    try:
        model.generate(**batch.kwargs(), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    finally:
        for handle in handles:
            handle.remove()
    vision = [name for name in ran if name.startswith("vision")]
    assert vision == ["vision first", "vision last"]
    counts = {name: ran.count(name) for name in watched.keys() - {"vision first", "vision last"}}
    assert counts == dict.fromkeys(counts, 3)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_text_positions_of_what_generate_passes(models, family):
    """Whatever position ids ``generate()`` hands the multimodal model (``[B, S]``, or M-RoPE's
    ``[3 or 4, B, S]``), ``text_positions`` reads the text positions ``cumsum(mask) - 1`` (0 on padding):
    at prefill, at each decode step, and on a second turn that continues the returned cache (only the
    unseen tokens, positions continuing over the whole conversation). ``continuation_position_ids`` gives
    ids whose text positions are those again."""
    model = models[family]
    adapter = adapter_for(model)
    batch = FAMILIES[family][1](model, 2)
    calls = []

    def record(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        calls.append((ids.shape[1], kwargs["position_ids"]))

    hook = adapter.multimodal_model(model).register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            out = model.generate(
                **batch.kwargs(),
                max_new_tokens=3,
                min_new_tokens=3,
                do_sample=False,
                return_dict_in_generate=True,
            )
            history = torch.cat([out.sequences, torch.full((2, 4), TEXT_LO)], dim=1)
            mask = torch.cat([batch.attention_mask, torch.ones_like(history[:, batch.seq_len :])], dim=1)
            turn = {k: v for k, v in batch.kwargs().items() if not k.startswith("pixel_values")}
            turn |= {"input_ids": history, "attention_mask": mask}
            if batch.mm_token_type_ids is not None:  # Qwen-VL: text tokens are type 0
                extra = history.shape[1] - batch.seq_len
                turn["mm_token_type_ids"] = torch.cat(
                    [batch.mm_token_type_ids, torch.zeros(2, extra).long()], 1
                )
            model.generate(**turn, past_key_values=out.past_key_values, max_new_tokens=1, do_sample=False)
    finally:
        hook.remove()
    full = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # [B, S + 3 + 4]
    seq = batch.seq_len
    seen = seq + 2  # the cache holds the prompt and the first two generated tokens
    assert [length for length, _ in calls] == [seq, 1, 1, history.shape[1] - seen]
    expected = [full[:, :seq], full[:, seq : seq + 1], full[:, seq + 1 : seq + 2], full[:, seen:]]
    for (_, position_ids), want in zip(calls, expected, strict=True):
        text = adapter.text_positions(model, position_ids)
        assert torch.equal(text, want)
        assert torch.equal(
            adapter.text_positions(model, adapter.continuation_position_ids(model, text)), want
        )


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_dummy_inputs_run_and_parse(models, family):
    """The benchmark prompt (``dummy_inputs`` at the tiny sizes) runs through the stock model, which
    checks that its placeholder runs are as long as the visual features; ``visual_items`` finds one
    image per row, of the expected size."""
    model = models[family]
    adapter = adapter_for(model)
    inputs = families.dummy_inputs(adapter, model.config, 2, 8, torch.Generator().manual_seed(0))
    inputs = compat.inputs.rename_image_argument(model, inputs)
    inputs = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    items = adapter.visual_items(model.config, inputs["input_ids"])
    assert [(item.row, item.size, item.modality) for item in items] == [
        (row, DUMMY_TOKENS[family], "image") for row in range(2)
    ]
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_queries_keys_and_rope_reproduce_the_attention_weights(family):
    """For every layer a method can score, softmax(rotate(q) rotate(k)^T * scaling + mask) from the
    captured q/k projection outputs, through ``queries_and_keys``, ``rotate`` and the layer's own position
    embeddings and mask, equals the weights eager attention computes (one unpadded row: eager float64
    turns padded rows into NaNs); without the rotation it does not, and ``inverse_rope`` undoes it (in
    layers without RoPE, Llama 4's NoPE layers, ``rotate`` leaves them as they are)."""
    model = FAMILIES[family][0](attn="eager")
    adapter = adapter_for(model)
    batch = FAMILIES[family][1](model, 1)
    layers = adapter.decoder_layers(model)
    stores: dict[int, dict] = {index: {} for index in adapter.scored_layers(model)}
    handles = []
    for index, store in stores.items():
        attention = adapter.attention(layers[index])

        def inputs(module, args, kwargs, store=store):
            store["rope"], store["mask"] = kwargs["position_embeddings"], kwargs["attention_mask"]

        def keep(name, store=store):
            return lambda module, args, out: store.__setitem__(name, out)

        handles += [
            attention.register_forward_pre_hook(inputs, with_kwargs=True),
            attention.register_forward_hook(
                lambda module, args, out, store=store: store.update(weights=out[1])
            ),
            adapter.query_projection(attention).register_forward_hook(keep("q")),
            adapter.key_projection(attention).register_forward_hook(keep("k")),
        ]
    try:
        with torch.no_grad():
            model(**batch.kwargs())
    finally:
        for handle in handles:
            handle.remove()
    unrotated = []
    for index, store in stores.items():
        attention = adapter.attention(layers[index])
        queries, keys = adapter.queries_and_keys(attention, store["q"], store["k"])

        def weights(rotate, queries=queries, keys=keys, attention=attention, store=store):
            q, k = (rotate(attention, x, store["rope"]) for x in (queries, keys))
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scores = q @ k.transpose(-1, -2) * adapter.scaling(attention)
            if store["mask"] is not None:
                scores = scores + store["mask"]
            return scores.softmax(-1, dtype=torch.float32).to(scores.dtype)

        torch.testing.assert_close(weights(adapter.rotate), store["weights"], atol=1e-6, rtol=0)
        if torch.equal(adapter.rotate(attention, keys, store["rope"]), keys):
            unrotated.append(index)  # a layer without RoPE (Llama 4's NoPE layers)
            continue
        assert (weights(lambda attention, x, rope: x) - store["weights"]).abs().max() > 1e-4, index
        rotated = adapter.rotate(attention, keys, store["rope"])
        back = adapter.rotate(attention, rotated, adapter.inverse_rope(store["rope"]))
        torch.testing.assert_close(back, keys, atol=1e-6, rtol=0)  # (cos, sin) come from float32
    assert len(unrotated) < len(stores), "no layer rotates its queries and keys"
