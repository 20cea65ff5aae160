"""LLaVA-OneVision-1.5's Qwen2-VL markers over a 1-D RoPE Qwen3 decoder, and GLM-4.6V's two text models,
against the stock models' own layout and attention.

Each check reads what the stock model does (where it scatters features, the position ids its language
model receives, its eager attention weights, ``get_rope_index``), so a transformers change to any of these
facts fails here first; the negative controls show what reading either family as its look-alike
(Qwen2-VL, GLM-4.1V) gets wrong.
"""

from __future__ import annotations

import pytest
import torch

import priortr
from priortr.adapters import adapter_for, glm46v
from priortr.adapters.glm4v import Glm4vAdapter
from priortr.adapters.llava_onevision1_5 import LlavaOnevision15Adapter
from priortr.adapters.qwen2_vl import QwenVLAdapter
from tests.helpers.tiny import QWEN_VISION_END_ID, language_model_inputs
from tests.helpers.tiny_glm4v import GLM_IMAGE_END_ID, glm4v_batch, glm4v_multi_image_batch, glm4v_video_batch
from tests.helpers.tiny_glm46v import tiny_glm46v, tiny_glm46v_moe
from tests.helpers.tiny_llava_onevision1_5 import (
    llava_onevision1_5_multi_image_batch,
    llava_onevision1_5_ragged_batch,
    llava_onevision1_5_video_batch,
    tiny_llava_onevision1_5,
)

OV_LAYOUTS = [
    llava_onevision1_5_ragged_batch,
    llava_onevision1_5_multi_image_batch,
    llava_onevision1_5_video_batch,
]


def _scattered_at(model, batch) -> tuple[torch.Tensor, dict]:
    """[B, S] True where the stock model wrote visual features into the input embeddings, and what it
    handed its language model."""
    seen = language_model_inputs(model, batch)
    text = model.get_input_embeddings()(batch.input_ids)
    return (seen["inputs_embeds"] - text).abs().amax(-1) > 0, seen


@pytest.mark.parametrize("layout", OV_LAYOUTS, ids=lambda f: f.__name__)
def test_llava_onevision1_5_items_are_the_scattered_runs_closed_by_vision_end(layout):
    """Every image and every video is one item: exactly the positions the model writes its features to,
    closed by ``<|vision_end|>``; the language model numbers the prompt ``0 .. S-1`` with 1-D ids, which
    are its text positions."""
    model = tiny_llava_onevision1_5()
    batch = layout(model, 3)
    items = LlavaOnevision15Adapter().visual_items(model.config, batch.input_ids)
    scattered, seen = _scattered_at(model, batch)
    covered = torch.zeros_like(scattered)
    for item in items:
        covered[item.row, item.positions] = True
        assert batch.input_ids[item.row, item.separator] == QWEN_VISION_END_ID
    assert torch.equal(covered, scattered)
    grids = [*batch.image_grid_thw.tolist()] if batch.image_grid_thw is not None else []
    grids += batch.extra["video_grid_thw"].tolist() if "video_grid_thw" in batch.extra else []
    assert sorted(item.size for item in items) == sorted(t * h * w // 4 for t, h, w in grids)
    assert torch.equal(seen["position_ids"], torch.arange(batch.seq_len)[None])  # 1-D, no M-RoPE rows
    adapter = adapter_for(model)
    assert torch.equal(adapter.text_positions(model, seen["position_ids"]), seen["position_ids"])


def test_llava_onevision1_5_image_grids_are_the_towers_merged_raster():
    """``item_grids`` lays an image's tokens on (h/2, w/2) of its ``image_grid_thw``: token i is the 2x2
    block at (i // (w/2), i % (w/2)) of the tower's own 2-D RoPE ids (blocks in raster order)."""
    from transformers.vision_utils import get_vision_position_ids

    model = tiny_llava_onevision1_5()
    batch = llava_onevision1_5_multi_image_batch(model, 1)
    adapter = LlavaOnevision15Adapter()
    items = adapter.item_grids(
        model.config, adapter.visual_items(model.config, batch.input_ids), batch.kwargs()
    )
    assert [item.grid for item in items] == [(2, 2), (3, 4)]
    for item, grid_thw in zip(items, batch.image_grid_thw, strict=True):
        ids = get_vision_position_ids(grid_thw[None], 2)  # [h*w, 2] (row, col) per patch, block-major
        blocks = ids[::4] // 2  # each merged token's block
        rows, cols = item.grid
        assert blocks.tolist() == [[i // cols, i % cols] for i in range(rows * cols)]


def test_llava_onevision1_5_refuses_m_rope_ids_that_qwen2_vl_reads():
    """Ids of Qwen2-VL's shapes are refused, where Qwen2-VL's adapter would read row 0 of them; and its
    continuation needs ``rope_deltas``, which this model does not have."""
    model = tiny_llava_onevision1_5()
    adapter = LlavaOnevision15Adapter()
    positions = torch.arange(6)[None].expand(2, -1)
    for rows in (4, 3, 1):
        with pytest.raises(ValueError, match=r"1-D RoPE: position ids must be \[B, S\]"):
            adapter.text_positions(model, positions[None].expand(rows, -1, -1))
    assert torch.equal(adapter.continuation_position_ids(model, positions), positions)
    with pytest.raises(AttributeError, match="rope_deltas"):
        QwenVLAdapter().continuation_position_ids(model, positions)


def _eager_layer(model, batch, layer: int) -> dict:
    """What attention ``layer`` of the eager ``model`` saw and computed on ``batch``: its q/k projection
    outputs, position embeddings, mask and attention weights."""
    attention = model.model.language_model.layers[layer].self_attn
    store: dict = {}
    handles = [
        attention.register_forward_pre_hook(
            lambda m, a, k: store.update(rope=k["position_embeddings"], mask=k["attention_mask"]),
            with_kwargs=True,
        ),
        attention.register_forward_hook(lambda m, a, out: store.update(weights=out[1])),
        attention.q_proj.register_forward_hook(lambda m, a, out: store.update(q=out)),
        attention.k_proj.register_forward_hook(lambda m, a, out: store.update(k=out)),
    ]
    try:
        with torch.no_grad():
            model(**batch.kwargs())
    finally:
        for handle in handles:
            handle.remove()
    store["attention"] = attention
    return store


def _recomputed(adapter, store: dict, *, reader=None, rotate=None) -> torch.Tensor:
    """softmax(rotate(q) rotate(k)^T * scaling + mask) from the stored projections, with ``adapter``'s
    per-head reading and rotation unless ``reader`` / ``rotate`` replace them."""
    attention = store["attention"]
    queries, keys = (reader or adapter.queries_and_keys)(attention, store["q"], store["k"])
    q, k = ((rotate or adapter.rotate)(attention, x, store["rope"]) for x in (queries, keys))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) * adapter.scaling(attention) + store["mask"]
    return scores.softmax(-1, dtype=torch.float32).to(scores.dtype)  # as eager attention does


def test_llava_onevision1_5_attention_needs_the_qk_norms_qwen2_vl_skips():
    """The adapter's queries and keys (Qwen3's q/k norms) give the eager weights; Qwen2-VL's reading, the
    raw projections, gives other weights, so it would rank (and keep) other tokens."""
    model = tiny_llava_onevision1_5(attn="eager")
    batch = llava_onevision1_5_ragged_batch(model, 1)
    store = _eager_layer(model, batch, 1)
    adapter = LlavaOnevision15Adapter()
    torch.testing.assert_close(_recomputed(adapter, store), store["weights"], atol=1e-6, rtol=0)
    qwen2_vl = _recomputed(adapter, store, reader=QwenVLAdapter().queries_and_keys)
    assert (qwen2_vl - store["weights"]).abs().max() > 1e-3


@pytest.mark.parametrize("build", [tiny_glm46v, tiny_glm46v_moe], ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "layout", [glm4v_batch, glm4v_multi_image_batch, glm4v_video_batch], ids=lambda f: f.__name__
)
def test_glm46v_items_are_the_placeholder_runs_with_their_3d_grids(build, layout):
    """Every ``<|image|>`` run is an item (an image, or a video frame written with the image placeholder,
    then of modality ``video``), exactly where the model scatters features, closed by ``<|end_of_image|>``,
    and its ``get_rope_index`` ids are one raster grid: one temporal id, rows and columns from its first
    token."""
    model = build()
    batch = layout(model, 2)
    items = adapter_for(model).visual_items(model.config, batch.input_ids)
    scattered, _ = _scattered_at(model, batch)
    position_ids, _ = model.model.get_rope_index(
        batch.input_ids,
        mm_token_type_ids=batch.mm_token_type_ids,
        image_grid_thw=batch.image_grid_thw,
        video_grid_thw=batch.extra.get("video_grid_thw"),
        attention_mask=batch.attention_mask,
    )  # [3, B, S]
    covered = torch.zeros_like(scattered)
    for item in items:
        covered[item.row, item.positions] = True
        assert batch.input_ids[item.row, item.separator] == GLM_IMAGE_END_ID
        types = batch.mm_token_type_ids[item.row, item.positions]
        assert (types == (2 if item.modality == "video" else 1)).all()
        t, h, w = position_ids[:, item.row, item.positions]
        assert t.unique().numel() == 1
        cols = int(w.max() - w.min()) + 1
        assert ((h - h.min()) * cols + (w - w.min())).tolist() == list(range(item.size))
    assert torch.equal(covered, scattered)
    assert any(item.modality == "video" for item in items) == (layout is glm4v_video_batch)


@pytest.mark.parametrize(
    ("build", "other"),
    [(tiny_glm46v, tiny_glm46v_moe), (tiny_glm46v_moe, tiny_glm46v)],
    ids=["dense", "moe"],
)
def test_glm46v_rotates_as_its_text_model_does(build, other):
    """The dense text model rotates neighbouring pairs, the MoE one halves: the adapter gives each model's
    eager weights, and the other text model's rotation does not."""
    model = build(attn="eager")
    store = _eager_layer(model, glm4v_batch(model, 1), 1)
    adapter = glm46v.Glm46VAdapter()
    torch.testing.assert_close(_recomputed(adapter, store), store["weights"], atol=1e-6, rtol=0)
    wrong = glm46v.ROTATIONS[other().config.text_config.model_type]
    swapped = _recomputed(
        adapter, store, rotate=lambda attention, x, rope: glm46v.apply_rope(x, *rope, rotate=wrong)
    )
    assert (swapped - store["weights"]).abs().max() > 1e-3
    if build is tiny_glm46v_moe:  # GLM-4.1V's adapter reads the MoE model as pairs: wrong weights
        glm41v = _recomputed(adapter, store, rotate=Glm4vAdapter().rotate)
        assert (glm41v - store["weights"]).abs().max() > 1e-3


def test_glm46v_an_unknown_text_model_is_refused_at_apply(monkeypatch):
    model = tiny_glm46v()
    monkeypatch.delitem(glm46v.ROTATIONS, "glm4v_text")
    with pytest.raises(ValueError, match="text model is 'glm4v_text', whose RoPE priortr does not know"):
        priortr.apply(model, budget=4, layer=1)


def test_glm46v_pruning_keeps_every_frame_marker():
    """A video's frames are pruned one by one: every ``<|begin_of_image|>`` / ``<|end_of_image|>`` and
    timestamp stays, and a budget of 2 keeps one token of each 4-token frame."""
    model = tiny_glm46v_moe()
    batch = glm4v_video_batch(model, 2)
    with priortr.apply(model, budget=2, layer=1) as handle, torch.no_grad():
        model(**batch.kwargs())
    result = handle.last
    visual = batch.visual_mask()
    items = adapter_for(model).visual_items(model.config, batch.input_ids)
    for row in range(2):
        prompt = batch.attention_mask[row].bool()
        kept = set(result.positions[row][~result.padding[row]].tolist()) & set(
            prompt.nonzero().flatten().tolist()
        )
        text = set((~visual[row] & prompt).nonzero().flatten().tolist())
        assert text <= kept
        frames = [set(item.positions.tolist()) for item in items if item.row == row]
        assert [len(frame & kept) for frame in frames] == [1, 1]
        assert kept - text == set().union(*frames) & kept
