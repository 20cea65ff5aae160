"""The InternVL and Idefics3/SmolVLM adapters against the tiny models of
``tests.helpers.tiny_internvl_smolvlm``.

Checks what only these families do: which positions make up each image and its separator (per image,
with SmolVLM's several runs per image) and that ``queries_and_keys`` reproduce the model's own attention
(with Qwen3's q/k norms). What every adapter does is in ``test_adapter_contract.py``.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from priortr.adapters import adapter_for
from priortr.adapters.base import FamilyAdapter, VisualItem, visual_runs
from priortr.adapters.idefics3 import Idefics3Adapter
from tests.helpers.tiny import BOS_ID, Batch
from tests.helpers.tiny_internvl_smolvlm import (
    INTERNVL_END_ID,
    INTERNVL_START_ID,
    SMOLVLM_FAKE_ID,
    SMOLVLM_GLOBAL_ID,
    SMOLVLM_IMAGE_ID,
    SMOLVLM_ROW_COL_ID,
    SMOLVLM_SUB_TOKENS,
    internvl_batch,
    internvl_multi_image_batch,
    internvl_ragged_batch,
    internvl_tiles_batch,
    smolvlm_batch,
    smolvlm_image_ids,
    smolvlm_multi_image_batch,
    smolvlm_ragged_batch,
    tiny_idefics3,
    tiny_internvl,
    tiny_smolvlm,
)

BUILDERS = {"internvl": tiny_internvl, "smolvlm": tiny_smolvlm, "idefics3": tiny_idefics3}
BATCHES = {"internvl": internvl_batch, "smolvlm": smolvlm_batch, "idefics3": smolvlm_batch}


def items_by_row(items: list[VisualItem], batch_size: int) -> list[list[VisualItem]]:
    rows: list[list[VisualItem]] = [[] for _ in range(batch_size)]
    for item in items:
        rows[item.row].append(item)
    return rows


def check_covers_visual_mask(items: list[VisualItem], batch: Batch) -> None:
    """The items' positions are ascending, disjoint, in prompt order and cover exactly the visual tokens."""
    covered = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    previous = {}
    for item in items:
        assert torch.all(item.positions[1:] > item.positions[:-1])
        assert int(item.positions[0]) > previous.get(item.row, -1)
        assert not covered[item.row, item.positions].any()
        covered[item.row, item.positions] = True
        previous[item.row] = int(item.positions[-1])
    assert torch.equal(covered, batch.visual_mask())


# ---- adapter lookup and attention ---------------------------------------------------------------------


def test_smolvlm_and_idefics3_share_one_adapter_and_no_family_has_a_vision_probe(models):
    assert adapter_for(models["smolvlm"]) is adapter_for(models["idefics3"])
    for family in BUILDERS:
        assert adapter_for(models[family]).vision_probe(models[family]) is None


@pytest.mark.parametrize("family", ["internvl", "internvl-qwen3", "smolvlm"])
def test_queries_and_keys_reproduce_the_models_attention(models, family):
    """softmax(RoPE(q) RoPE(k)^T * scaling) from the captured projections equals eager attention weights,
    so q/k norms (Qwen3 text, as InternVL3.5) are applied where the model applies them."""
    if family == "internvl-qwen3":
        model = tiny_internvl(attn="eager", text="qwen3")
        assert hasattr(model.model.language_model.layers[0].self_attn, "q_norm")
    else:
        model = BUILDERS[family](attn="eager")
    adapter = adapter_for(model)
    layer = adapter.decoder_layers(model)[1]
    attention = adapter.attention(layer)
    captured = {}
    hooks = [
        adapter.query_projection(attention).register_forward_hook(lambda m, a, out: captured.update(q=out)),
        adapter.key_projection(attention).register_forward_hook(lambda m, a, out: captured.update(k=out)),
        layer.register_forward_pre_hook(
            lambda m, a, kw: captured.update(rope=kw["position_embeddings"]), with_kwargs=True
        ),
    ]
    batch = BATCHES[family.split("-")[0]](model, batch_size=1)
    try:
        with torch.no_grad():
            weights = model(**batch.kwargs(), output_attentions=True).attentions[1]  # [1, H, S, S]
    finally:
        for hook in hooks:
            hook.remove()
    queries, keys = adapter.queries_and_keys(attention, captured["q"], captured["k"])
    cos, sin = captured["rope"]
    queries, keys = apply_rotary_pos_emb(queries, keys, cos, sin)
    keys = keys.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)
    scores = queries @ keys.transpose(-1, -2) * attention.scaling
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    expected = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(weights, expected, atol=1e-6, rtol=0)  # eager softmax runs in float32
    if family == "internvl-qwen3":  # control: the norms matter
        plain, _ = FamilyAdapter.queries_and_keys(adapter, attention, captured["q"], captured["k"])
        assert not torch.allclose(plain, adapter.queries_and_keys(attention, captured["q"], captured["k"])[0])


# ---- InternVL visual items ----------------------------------------------------------------------------


@pytest.mark.parametrize("make_batch, size", [(internvl_batch, 16), (internvl_tiles_batch, 48)])
def test_internvl_one_item_per_image_with_all_tiles(models, make_batch, size):
    model = models["internvl"]
    batch = make_batch(model, batch_size=3)
    items = adapter_for(model).visual_items(model.config, batch.input_ids)
    assert [item.row for item in items] == [0, 1, 2]
    for item, start, end in zip(items, batch.image_start, batch.image_end, strict=True):
        assert item.size == size == batch.n_visual
        assert torch.equal(item.positions, torch.arange(start, end))
        assert item.separator == end and batch.input_ids[item.row, end] == INTERNVL_END_ID
        assert batch.input_ids[item.row, start - 1] == INTERNVL_START_ID
        assert item.modality == "image"
    check_covers_visual_mask(items, batch)


def test_internvl_ragged_and_multi_image(models):
    model = models["internvl"]
    adapter = adapter_for(model)
    ragged = internvl_ragged_batch(model, batch_size=3)
    items = adapter.visual_items(model.config, ragged.input_ids)
    assert [(item.row, item.size) for item in items] == [(0, 48), (1, 16), (2, 32)]
    check_covers_visual_mask(items, ragged)

    multi = internvl_multi_image_batch(model, batch_size=2)
    items = adapter.visual_items(model.config, multi.input_ids)
    assert [(item.row, item.size) for item in items] == [(0, 32), (0, 16), (1, 16), (1, 32)]
    for item in items:
        ids = multi.input_ids[item.row]
        assert ids[item.separator] == INTERNVL_END_ID and ids[int(item.positions[0]) - 1] == INTERNVL_START_ID
        assert item.separator == int(item.positions[-1]) + 1
    check_covers_visual_mask(items, multi)


# ---- SmolVLM / Idefics3 visual items ------------------------------------------------------------------


def check_smolvlm_items(items: list[VisualItem], batch: Batch, grids: list[list[tuple[int, int]]]) -> None:
    """Each item is one image of the builder's layout: ``rows * cols`` sub-image runs, each after its
    ``<row_i_col_j>`` tag, then the ``<global-img>`` run; the separator is the ``<fake>`` closing it."""
    by_row = items_by_row(items, batch.batch_size)
    assert [len(row) for row in by_row] == [len(g) for g in grids]
    for row_items, row_grids in zip(by_row, grids, strict=True):
        for item, (rows, cols) in zip(row_items, row_grids, strict=True):
            ids = batch.input_ids[item.row]
            runs = visual_runs(ids[None], SMOLVLM_IMAGE_ID)[0]
            mine = [(s, e) for s, e in runs if item.positions[0] <= s <= item.positions[-1]]
            assert len(mine) == rows * cols + 1
            assert item.size == len(mine) * SMOLVLM_SUB_TOKENS
            tags = [int(ids[s - 1]) for s, _ in mine]
            assert tags == [SMOLVLM_ROW_COL_ID + 3 * i + j for i in range(rows) for j in range(cols)] + [
                SMOLVLM_GLOBAL_ID
            ]
            assert item.separator == mine[-1][1] and ids[item.separator] == SMOLVLM_FAKE_ID
    check_covers_visual_mask(items, batch)


@pytest.mark.parametrize("family", ["smolvlm", "idefics3"])
def test_smolvlm_one_item_per_image_across_its_runs(models, family):
    model = models[family]
    adapter = adapter_for(model)
    batch = smolvlm_batch(model, batch_size=3)
    items = adapter.visual_items(model.config, batch.input_ids)
    assert [item.size for item in items] == [45, 45, 45]
    check_smolvlm_items(items, batch, [[(2, 2)]] * 3)

    ragged = smolvlm_ragged_batch(model, batch_size=3)
    items = adapter.visual_items(model.config, ragged.input_ids)
    assert [item.size for item in items] == [45, 9, 36]
    check_smolvlm_items(items, ragged, [[(2, 2)], [(0, 0)], [(1, 3)]])

    multi = smolvlm_multi_image_batch(model, batch_size=2)
    items = adapter.visual_items(model.config, multi.input_ids)
    assert [(item.row, item.size) for item in items] == [(0, 27), (0, 9), (1, 9), (1, 27)]
    check_smolvlm_items(items, multi, [[(1, 2), (0, 0)], [(0, 0), (1, 2)]])


def test_smolvlm_grouping_survives_multi_token_tags_and_adjacent_images(models):
    """Tags and newlines the tokenizer splits into several ids, and two images with no text between them
    (the closer of one followed at once by the opener of the next), still give one item per image."""
    config = models["smolvlm"].config

    def split(ids: list[int]) -> list[int]:
        out = []
        for token in ids:
            if token in (SMOLVLM_FAKE_ID, SMOLVLM_IMAGE_ID):
                out.append(token)
            else:
                out += [token, 5, 6]  # every tag and newline becomes three ids
        return out

    row = [BOS_ID, 7, 8, *split(smolvlm_image_ids((2, 1))), *split(smolvlm_image_ids((0, 0)))]
    row += [*split(smolvlm_image_ids((1, 2))), 9, 10, 11]
    ids = torch.tensor([row])
    items = Idefics3Adapter().visual_items(config, ids)
    assert [item.size for item in items] == [27, 9, 27]
    runs = visual_runs(ids, SMOLVLM_IMAGE_ID)[0]
    ends = [runs[2][1], runs[3][1], runs[6][1]]
    assert [item.separator for item in items] == ends
    assert all(ids[0, end] == SMOLVLM_FAKE_ID for end in ends)
    assert torch.equal(
        torch.cat([item.positions for item in items]), (ids[0] == SMOLVLM_IMAGE_ID).nonzero()[:, 0]
    )


def test_smolvlm_prompt_ending_inside_an_image_is_refused(models):
    config = models["smolvlm"].config
    row = [BOS_ID, 7, *smolvlm_image_ids((1, 2))[:-1]]  # the closing <fake> cut off
    with pytest.raises(ValueError, match="ends inside an image"):
        Idefics3Adapter().visual_items(config, torch.tensor([row]))
    single = Idefics3Adapter().visual_items(config, torch.tensor([[BOS_ID, *smolvlm_image_ids((0, 0))[:-1]]]))
    assert [(item.size, item.separator) for item in single] == [(9, 12)]  # one run: its own image
