"""The Qwen3-VL adapter against the stock transformers model: q/k norms, DeepStack, items, position ids.

Each check reads the model's own tensors (hooks on the stock modules), so a transformers change to any of
these facts fails here first.
"""

from __future__ import annotations

import pytest
import torch

from priortr.adapters.base import FamilyAdapter
from priortr.adapters.qwen3_vl import Qwen3VLAdapter
from priortr.tools import families
from tests.helpers.tiny import QWEN_IMAGE_ID, QWEN_VIDEO_ID, QWEN_VISION_END_ID, Batch
from tests.helpers.tiny_qwen3_vl import (
    BATCHES,
    INJECTED_LAYERS,
    qwen3_vl_ragged_batch,
    qwen3_vl_video_batch,
    tiny_qwen3_vl,
    tiny_qwen3_vl_moe,
)

BUILDERS = {"dense": tiny_qwen3_vl, "moe": tiny_qwen3_vl_moe}
ADAPTER = Qwen3VLAdapter()


@pytest.fixture(scope="module")
def model(models):
    return models["qwen3-vl"]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with the (cos, sin) [B, S, d] a decoder layer receives (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _attention_weights(adapter: FamilyAdapter, attention, captured: dict) -> torch.Tensor:
    """Softmax attention [B, H, S, S] recomputed from the captured projection outputs, RoPE and mask; the
    softmax in float32, as transformers' ``eager_attention_forward`` takes it."""
    queries, keys = adapter.queries_and_keys(attention, captured["q"], captured["k"])
    cos, sin = captured["position_embeddings"]
    queries, keys = _rope(queries, cos, sin), _rope(keys, cos, sin)
    keys = keys.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)
    scores = queries @ keys.transpose(-1, -2) * attention.scaling + captured["attention_mask"]
    return scores.softmax(-1, dtype=torch.float32).to(scores.dtype)


@pytest.mark.parametrize("family", BUILDERS)
def test_queries_and_keys_apply_the_norms_before_rope(family):
    """Eager attention weights of every layer equal those recomputed from q_proj/k_proj outputs through
    ``queries_and_keys`` and the layer's ``position_embeddings``; without the norms they do not.

    One unpadded row: in float64, eager attention turns a left-padded row into NaNs (its float32 softmax
    of a fully masked padding query is NaN, and the NaN hidden states reach every query from layer 1 on)."""
    model = BUILDERS[family](attn="eager")
    batch = qwen3_vl_video_batch(model, batch_size=1, with_image=True)
    captured, handles = [], []
    for layer in ADAPTER.decoder_layers(model):
        store: dict = {}
        attention = ADAPTER.attention(layer)

        def inputs(module, args, kwargs, store=store):
            store["position_embeddings"] = kwargs["position_embeddings"]
            store["attention_mask"] = kwargs["attention_mask"]

        def output(name, store=store):
            return lambda module, args, out: store.__setitem__(name, out)

        handles += [
            attention.register_forward_pre_hook(inputs, with_kwargs=True),
            ADAPTER.query_projection(attention).register_forward_hook(output("q")),
            ADAPTER.key_projection(attention).register_forward_hook(output("k")),
        ]
        captured.append(store)
    with torch.no_grad():
        attentions = model(**batch.kwargs(), output_attentions=True).attentions
    for handle in handles:
        handle.remove()
    for layer, store, eager in zip(ADAPTER.decoder_layers(model), captured, attentions, strict=True):
        attention = ADAPTER.attention(layer)
        recomputed = _attention_weights(ADAPTER, attention, store)
        torch.testing.assert_close(recomputed, eager, atol=1e-7, rtol=0)  # float32 softmax
        without_norms = _attention_weights(FamilyAdapter(), attention, store)
        assert (without_norms - eager).abs().max() > 1e-3


def _expected_grids(model, batch: Batch) -> dict[str, list[tuple[int, int]]]:
    """Merged (rows, cols) of every item the model's M-RoPE lays out, per modality in prompt order; a video
    of ``t`` temporal patches is ``t`` frame grids (``get_rope_index`` splits ``video_grid_thw`` so)."""
    merge = model.config.vision_config.spatial_merge_size
    grids: dict[str, list[tuple[int, int]]] = {"image": [], "video": []}
    for modality, key in (("image", "image_grid_thw"), ("video", "video_grid_thw")):
        for t, h, w in batch.kwargs().get(key, torch.zeros(0, 3)).tolist():
            grids[modality] += [(h // merge, w // merge)] * t
    return grids


@pytest.mark.parametrize("layout", BATCHES)
def test_visual_items_are_the_placeholder_runs_with_their_vision_end(model, layout):
    """Items cover exactly the placeholder positions, each ends at a ``<|vision_end|>`` separator, and each
    is one raster grid of the model's own M-RoPE ids (one per image, one per video frame)."""
    batch = BATCHES[layout](model, batch_size=3)
    ids = batch.input_ids
    items = ADAPTER.visual_items(model.config, ids)
    visual = batch.visual_mask()
    for row in range(batch.batch_size):
        positions = torch.cat([item.positions for item in items if item.row == row])
        assert positions.tolist() == visual[row].nonzero().flatten().tolist()
    position_ids, _ = model.model.get_rope_index(
        ids,
        mm_token_type_ids=batch.mm_token_type_ids,
        image_grid_thw=batch.image_grid_thw,
        video_grid_thw=batch.extra.get("video_grid_thw"),
        attention_mask=batch.attention_mask,
    )  # [3, B, S]: temporal, height, width
    grids = {modality: iter(grid) for modality, grid in _expected_grids(model, batch).items()}
    placeholder = {"image": QWEN_IMAGE_ID, "video": QWEN_VIDEO_ID}
    for item in sorted(items, key=lambda item: (item.modality != "image", item.row, int(item.positions[0]))):
        assert item.size == item.positions[-1] - item.positions[0] + 1  # one run
        assert (ids[item.row, item.positions] == placeholder[item.modality]).all()
        assert (
            item.separator == item.positions[-1] + 1 and ids[item.row, item.separator] == QWEN_VISION_END_ID
        )
        rows, cols = next(grids[item.modality])
        t, h, w = position_ids[:, item.row, item.positions]
        assert item.size == rows * cols and t.unique().numel() == 1
        assert (h - h.min()).tolist() == torch.arange(rows).repeat_interleave(cols).tolist()
        assert (w - w.min()).tolist() == torch.arange(cols).repeat(rows).tolist()
    assert all(next(grid, None) is None for grid in grids.values())


def test_visual_grid_is_the_merged_image_grid(model):
    batch = BATCHES["image"](model, batch_size=2)
    assert families.visual_grid(ADAPTER, model.config, batch.kwargs(), 1) == (3, 4)  # 6x8 patches, 2x2 merge


class _HiddenStates:
    """Records each decoder layer's output and the hidden states the text model feeds on (the next layer's
    input, the final norm's input after the last layer), forward call by forward call."""

    def __init__(self, model):
        layers = ADAPTER.decoder_layers(model)
        self.layers = len(layers)
        self.outputs: list[torch.Tensor] = []
        self.next_inputs: list[torch.Tensor] = []
        self.handles = [layer.register_forward_hook(self._output) for layer in layers]
        feeds = [*list(layers)[1:], ADAPTER.language_model(model).norm]
        self.handles += [module.register_forward_pre_hook(self._next_input) for module in feeds]

    def _output(self, module, args, out):
        self.outputs.append(out)

    def _next_input(self, module, args):
        self.next_inputs.append(args[0])

    @property
    def calls(self) -> int:
        assert len(self.outputs) == len(self.next_inputs) and len(self.outputs) % self.layers == 0
        return len(self.outputs) // self.layers

    def changed(self, call: int) -> list[torch.Tensor]:
        """Per layer, [B, S] True where the text model changed the layer's output before feeding it on."""
        span = slice(call * self.layers, (call + 1) * self.layers)
        pairs = zip(self.outputs[span], self.next_inputs[span], strict=True)
        return [(fed - out).abs().amax(-1) > 0 for out, fed in pairs]

    def remove(self):
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize(
    ("family", "layout"),
    [("dense", "image"), ("dense", "ragged"), ("dense", "image+video"), ("moe", "ragged")],
)
def test_injected_layers_are_the_layers_deepstack_adds_to(family, layout):
    """DeepStack adds visual features to the outputs of the first ``injected_layers`` decoder layers, on
    exactly the visual positions, at prefill only (decode steps carry no pixels)."""
    model = BUILDERS[family]()
    batch = BATCHES[layout](model, batch_size=2)
    assert ADAPTER.injected_layers(model) == INJECTED_LAYERS
    recorder = _HiddenStates(model)
    with torch.no_grad():
        model.generate(**batch.kwargs(), max_new_tokens=2, min_new_tokens=2, do_sample=False)
    recorder.remove()
    assert recorder.calls == 2
    visual = batch.visual_mask()
    prefill = recorder.changed(0)
    assert len(prefill) == len(ADAPTER.decoder_layers(model))
    for index, changed in enumerate(prefill):
        expected = visual if index < ADAPTER.injected_layers(model) else torch.zeros_like(visual)
        assert torch.equal(changed, expected), index
    assert not any(changed.any() for changed in recorder.changed(1))


def test_injected_layers_counts_distinct_in_range_deepstack_blocks(model):
    """The vision tower emits a feature per block listed once in ``deepstack_visual_indexes``; an index
    past its depth never fires."""
    vision = model.config.vision_config
    original = vision.deepstack_visual_indexes
    try:
        vision.deepstack_visual_indexes = [0, 0, 1, vision.depth]
        assert ADAPTER.injected_layers(model) == 2
    finally:
        vision.deepstack_visual_indexes = original


def _recorded_positions(model, calls: list):
    def record(module, args, kwargs):
        calls.append((kwargs["position_ids"], kwargs["attention_mask"], kwargs["input_ids"].shape[1]))

    return ADAPTER.multimodal_model(model).register_forward_pre_hook(record, with_kwargs=True)


def test_text_positions_of_what_generate_passes(model):
    """Prefill and decode get ``[4, B, S]`` ids (row 0 the text positions), a second turn continuing the
    cache gets ``[1, B, S]`` text positions + ``rope_deltas``; ``text_positions`` finds the text positions
    in both, and ``continuation_position_ids`` rebuilds what generate passes."""
    batch = qwen3_vl_ragged_batch(model, batch_size=3)  # rows with different rope_deltas (-2, -3, -8)
    calls: list = []
    handle = _recorded_positions(model, calls)
    with torch.no_grad():
        first = model.generate(
            **batch.kwargs(),
            max_new_tokens=3,
            min_new_tokens=3,
            do_sample=False,
            return_dict_in_generate=True,
        )
        deltas = ADAPTER.multimodal_model(model).rope_deltas.flatten().tolist()
        turn = torch.randint(3, 190, (batch.batch_size, 4), generator=torch.Generator().manual_seed(1))
        ids = torch.cat([first.sequences, turn], dim=1)
        kwargs = {**batch.kwargs(), "input_ids": ids, "attention_mask": torch.ones_like(ids)}
        kwargs["attention_mask"][:, : batch.seq_len] = batch.attention_mask
        kwargs["mm_token_type_ids"] = (ids == QWEN_IMAGE_ID).long()
        kwargs.pop("pixel_values")  # the cache holds the image
        uncached = ids.shape[1] - first.past_key_values.get_seq_length()  # the last answer token + the turn
        model.generate(
            **kwargs,
            past_key_values=first.past_key_values,
            max_new_tokens=2,
            min_new_tokens=2,
            do_sample=False,
        )
    handle.remove()
    assert deltas == [-2, -3, -8]
    shapes = [(position_ids.shape[0], seq) for position_ids, _, seq in calls]
    assert shapes == [(4, batch.seq_len), (4, 1), (4, 1), (1, uncached), (1, 1)]
    for position_ids, mask, seq in calls:
        text = ADAPTER.text_positions(model, position_ids)  # [B, S]
        real = mask[:, -seq:].bool()
        expected = (mask.cumsum(-1) - 1)[:, -seq:]
        assert torch.equal(text[real], expected[real])
        rebuilt = ADAPTER.continuation_position_ids(model, text)
        if position_ids.shape[0] == 4 and seq == 1:
            assert torch.equal(rebuilt, position_ids)
        if position_ids.shape[0] == 1:
            assert torch.equal(rebuilt[1:], position_ids.expand(3, -1, -1))


def test_dummy_inputs_grid_is_576_merged_patches_per_row(model):
    """The benchmark prompt's ``image_grid_thw`` and pixels agree with its 576 tokens per row (the
    contract suite checks the token runs)."""
    inputs = families.dummy_inputs(ADAPTER, model.config, 2, 8, torch.Generator().manual_seed(0))
    items = ADAPTER.visual_items(model.config, inputs["input_ids"])
    assert all(inputs["input_ids"][item.row, item.separator] == QWEN_VISION_END_ID for item in items)
    merge = model.config.vision_config.spatial_merge_size
    assert (inputs["image_grid_thw"].prod(-1) // merge**2).tolist() == [576, 576]
    assert inputs["pixel_values"].shape[0] == inputs["image_grid_thw"].prod(-1).sum()


@pytest.mark.parametrize("layout", BATCHES)
def test_stock_forward_and_generate_run(model, layout):
    batch = BATCHES[layout](model, batch_size=2)
    with torch.no_grad():
        assert model(**batch.kwargs()).logits.shape[:2] == batch.input_ids.shape
        out = model.generate(**batch.kwargs(), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (2, batch.seq_len + 3)
