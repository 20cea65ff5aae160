"""The MiniCPM-V 4.6 / 4.7 and Molmo2 adapters against the tiny models of ``tests.helpers.tiny_minicpmv``
and ``tests.helpers.tiny_molmo2``; what every family does (equivalence, layouts, cache, methods) runs in
the suites over ``tests.helpers.families``.

Checks what only these families do: which positions make up each image (MiniCPM-V's global view and
slices, Molmo2's two views with ``<im_col>`` after every row) and its separator; MiniCPM-V's token count
set at call time (``downsample_mode``), its hybrid decoder and 4.7's canvas M-RoPE ids; Molmo2's
bidirectional image block, its q/k norms over the whole projection (``qk_norm_type="olmo"``) and its
image ids past the LM head's vocabulary; and a second turn on a pruned cache for each. A family's class
may be newer than a supported release; its tests skip there, naming the release.
"""

from __future__ import annotations

import pytest
import torch

import priortr
from priortr.adapters import adapter_for
from priortr.adapters.base import FamilyAdapter, VisualItem, visual_runs
from priortr.adapters.minicpmv import MiniCPMV4_7Adapter, MiniCPMVAdapter
from priortr.adapters.molmo2 import Molmo2Adapter
from tests.engine import test_equivalence
from tests.families import test_local_and_linear_attention
from tests.helpers.oracle import staged_reference
from tests.helpers.pruned import generate, kept_rows, logits_atol, pruned_columns, reference_for, stage_masks
from tests.helpers.tiny import BOS_ID
from tests.helpers.tiny_minicpmv import (
    IMAGE_END_ID,
    IMAGE_START_ID,
    MINICPMV_IMAGE_ID,
    MINICPMV_VIDEO_ID,
    NEWLINE_ID,
    SLICE_END_ID,
    SLICE_START_ID,
    minicpmv_4x_batch,
    minicpmv_batch,
    minicpmv_image_ids,
    minicpmv_multi_image_batch,
    minicpmv_ragged_batch,
    tiny_minicpmv4_6,
    tiny_minicpmv4_7,
)
from tests.helpers.tiny_molmo2 import (
    FRAME_END_ID,
    FRAME_START_ID,
    IM_COL_ID,
    IM_END_ID,
    IM_PATCH_ID,
    IM_START_ID,
    LOW_RES_START_ID,
    molmo2_batch,
    molmo2_image_ids,
    molmo2_multi_image_batch,
    molmo2_ragged_batch,
    tiny_molmo2,
    view_ids,
)


@pytest.fixture(scope="module")
def minicpmv():
    return tiny_minicpmv4_6()


@pytest.fixture(scope="module")
def molmo2():
    return tiny_molmo2()


def check_items(items: list[VisualItem], input_ids: torch.Tensor, token_id: int) -> None:
    """The items' positions are ascending, disjoint, in prompt order and cover exactly ``token_id``'s."""
    covered = torch.zeros_like(input_ids, dtype=torch.bool)
    for item in items:
        assert torch.all(item.positions[1:] > item.positions[:-1])
        assert not covered[item.row, item.positions].any()
        covered[item.row, item.positions] = True
    assert torch.equal(covered, input_ids == token_id)


# ---- MiniCPM-V 4.6 ------------------------------------------------------------------------------------


def test_minicpmv_is_registered_with_qwen3_5s_decoder_facts(minicpmv):
    adapter = adapter_for(minicpmv)
    assert type(adapter) is MiniCPMVAdapter and adapter.vision_probe(minicpmv) is None
    assert adapter.attention_layers(minicpmv) == [1, 3]
    assert adapter.vision_modules(minicpmv) == (minicpmv.model.vision_tower, minicpmv.model.merger)


@pytest.mark.parametrize(
    ("make_batch", "grids", "view"),
    [
        (minicpmv_batch, [[(2, 2)]] * 3, 4),
        (minicpmv_ragged_batch, [[(2, 2)], [(0, 0)], [(1, 3)]], 4),
        (minicpmv_multi_image_batch, [[(1, 2), (0, 0)], [(0, 0), (1, 2)], [(1, 2), (0, 0)]], 4),
        (minicpmv_4x_batch, [[(2, 2)]] * 3, 16),
    ],
)
def test_minicpmv_one_item_per_image_across_its_views(minicpmv, make_batch, grids, view):
    """Each image is one item of its global run and its slice runs (``view`` tokens each: 4 in the default
    16x mode, 16 when the call passes ``downsample_mode="4x"``); the separator is the ``</slice>`` closing
    its last slice, or its ``</image>`` when it is not sliced."""
    batch = make_batch(minicpmv, 3)
    items = adapter_for(minicpmv).visual_items(minicpmv.config, batch.input_ids)
    expected = [(row, rows * cols) for row, images in enumerate(grids) for rows, cols in images]
    assert [(item.row, item.size) for item in items] == [(row, (1 + n) * view) for row, n in expected]
    for item, (_, slices) in zip(items, expected, strict=True):
        ids = batch.input_ids[item.row]
        runs = [(s, e) for s, e in visual_runs(ids[None], MINICPMV_IMAGE_ID)[0] if s in item.positions]
        assert len(runs) == 1 + slices and ids[runs[0][0] - 1] == IMAGE_START_ID
        assert all(ids[s - 1] == SLICE_START_ID for s, _ in runs[1:])
        assert item.separator == runs[-1][1] == int(item.positions[-1]) + 1
        assert ids[item.separator] == (SLICE_END_ID if slices else IMAGE_END_ID)
    check_items(items, batch.input_ids, MINICPMV_IMAGE_ID)


def test_minicpmv_grouping_survives_image_ids_adjacent_images_and_frames(minicpmv):
    """``<image_id>i</image_id>`` before an image, a newline the tokenizer splits, two images with nothing
    between them, and a video (frames written as images, with the video placeholder, nothing between
    frames) still give one item per image and per frame."""
    config = minicpmv.config

    def split(ids: list[int]) -> list[int]:
        return [part for token in ids for part in ((token, 5, 6) if token == NEWLINE_ID else (token,))]

    image = split(minicpmv_image_ids((2, 1), 3))
    frame = [
        MINICPMV_VIDEO_ID if token == MINICPMV_IMAGE_ID else token for token in minicpmv_image_ids((1, 2), 2)
    ]
    row = [BOS_ID, 7, 191, 8, 190, *image, *minicpmv_image_ids((0, 0), 3), 9, *frame, *frame, 10, 11]
    ids = torch.tensor([row])
    items = MiniCPMVAdapter().visual_items(config, ids)
    assert [(item.size, item.modality) for item in items] == [
        (9, "image"),
        (3, "image"),
        (6, "video"),
        (6, "video"),
    ]
    assert [int(ids[0, item.separator]) for item in items] == [SLICE_END_ID, IMAGE_END_ID] + [
        SLICE_END_ID
    ] * 2
    check_items([i for i in items if i.modality == "image"], ids, MINICPMV_IMAGE_ID)


def test_minicpmv_4_7_keeps_its_canvas_positions():
    """MiniCPM-V 4.7 places each view on its image's canvas (M-RoPE ids, ``rope_deltas``): its adapter reads
    the text row of the ``[4, B, S]`` ids generate() passes, and its layout is 4.6's."""
    model = tiny_minicpmv4_7()
    adapter = adapter_for(model)
    assert type(adapter) is MiniCPMV4_7Adapter and adapter.attention_layers(model) == [1, 3]
    batch = minicpmv_multi_image_batch(model, 2)
    with torch.no_grad():
        model(**batch.kwargs())
    assert bool((model.model.rope_deltas != 0).all()), "the canvas ids must differ from the text positions"
    items = adapter.visual_items(model.config, batch.input_ids)
    assert [(item.row, item.size) for item in items] == [(0, 12), (0, 4), (1, 4), (1, 12)]


def test_minicpmv_prompts_off_the_layout_are_refused(minicpmv):
    config = minicpmv.config
    with pytest.raises(ValueError, match="no <image> marker before it"):
        MiniCPMVAdapter().visual_items(config, torch.tensor([[MINICPMV_IMAGE_ID] * 3 + [IMAGE_END_ID]]))
    rows = torch.tensor(
        [[BOS_ID, *minicpmv_image_ids((0, 0), 2)], [7, SLICE_START_ID, *minicpmv_image_ids((0, 0), 2)[1:]]]
    )
    with pytest.raises(ValueError, match="opened by different tokens"):
        MiniCPMVAdapter().visual_items(config, rows)


def test_minicpmv_scores_only_its_full_attention_layers(minicpmv):
    """Layers 0 and 2 are linear attention: a one-layer method is refused there, naming layer 1."""
    with pytest.raises(
        ValueError, match=r"decoder layer 2 of this model has no softmax attention.*score layer 1"
    ):
        priortr.apply(minicpmv, budget=4, layer=2)
    priortr.apply(minicpmv, budget=4, layer=1).remove()


def test_minicpmv_4x_mode_prunes_four_times_the_tokens_as_the_reference(minicpmv):
    """The token count follows the call's ``downsample_mode``: 80 visual tokens per row in 4x mode, 20 by
    default; both prune to the budget and equal the reference that runs each layer on the kept tokens."""
    for make_batch, n_visual in ((minicpmv_batch, 20), (minicpmv_4x_batch, 80)):
        batch = make_batch(minicpmv, 2)
        with priortr.apply(minicpmv, budget=6, layer=1) as handle, torch.no_grad():
            logits = minicpmv(**batch.kwargs()).logits
        result = handle.last
        assert result.n_visual.tolist() == [n_visual] * 2 and result.kept.shape == (2, 6)
        with (
            reference_for(minicpmv, [(1, pruned_columns(batch, result.kept))], batch.attention_mask),
            torch.no_grad(),
        ):
            reference, real = kept_rows(minicpmv(**batch.kwargs()).logits, result, batch)
        torch.testing.assert_close(logits[real], reference[real], atol=logits_atol(minicpmv), rtol=0)


# ---- Molmo2 -------------------------------------------------------------------------------------------


def test_molmo2_is_registered_and_its_image_ids_are_past_the_lm_head(molmo2):
    adapter = adapter_for(molmo2)
    assert type(adapter) is Molmo2Adapter and adapter.vision_probe(molmo2) is None
    heads = molmo2.lm_head.out_features
    assert min(IM_START_ID, IM_END_ID, IM_PATCH_ID, IM_COL_ID, LOW_RES_START_ID) >= heads
    assert molmo2.get_input_embeddings().num_embeddings > max(IM_PATCH_ID, IM_COL_ID)


@pytest.mark.parametrize(
    ("make_batch", "highs"),
    [
        (molmo2_batch, [[(3, 3)]] * 3),
        (molmo2_ragged_batch, [[(3, 3)], [(1, 2)], [(2, 3)]]),
        (molmo2_multi_image_batch, [[(2, 3), (1, 2)], [(1, 2), (2, 3)], [(2, 3), (1, 2)]]),
    ],
)
def test_molmo2_one_item_per_image_of_both_views(molmo2, make_batch, highs):
    """An image is one item: its 2 x 2 low-resolution patches and its high-resolution ones, one run per row
    of either view; the separator is the token after the ``<im_end>`` closing it (here text)."""
    batch = make_batch(molmo2, 3)
    items = adapter_for(molmo2).visual_items(molmo2.config, batch.input_ids)
    expected = [(row, high) for row, images in enumerate(highs) for high in images]
    assert [(item.row, item.size) for item in items] == [(row, 4 + h * w) for row, (h, w) in expected]
    for item, (_, (h, _)) in zip(items, expected, strict=True):
        ids = batch.input_ids[item.row]
        runs = [(s, e) for s, e in visual_runs(ids[None], IM_PATCH_ID)[0] if s in item.positions]
        assert (
            len(runs) == 2 + h
            and ids[runs[0][0] - 1] == LOW_RES_START_ID
            and ids[runs[2][0] - 1] == IM_START_ID
        )
        assert ids[runs[-1][1]] == IM_COL_ID and item.separator == runs[-1][1] + 2
        assert ids[item.separator - 1] == IM_END_ID and batch.mm_token_type_ids[item.row, item.separator] == 0
    check_items(items, batch.input_ids, IM_PATCH_ID)


def test_molmo2_layouts_of_other_processor_settings(molmo2):
    """Without column tokens, and with ``<im_start>`` opening both views (``use_single_crop_start_token=
    False``: views pair in order), the separator is the token after the image's ``<im_end>`` (the next
    image's opener where it follows at once); video frames are items of their own, closed by
    ``<frame_end>``."""
    config = molmo2.config

    def plain(start: int, grid: tuple[int, int]) -> list[int]:
        return [start, *[IM_PATCH_ID] * (grid[0] * grid[1]), IM_END_ID]

    no_columns = [*plain(LOW_RES_START_ID, (2, 2)), *plain(IM_START_ID, (2, 3))]
    both_start = [*view_ids(IM_START_ID, (2, 2)), *view_ids(IM_START_ID, (1, 2))]
    frame = [FRAME_START_ID, *[IM_PATCH_ID] * 4, FRAME_END_ID]
    row = [BOS_ID, 7, *no_columns, 8, *both_start, *both_start, 9, 5, *frame, 6, *frame, 10]
    ids = torch.tensor([row])
    items = Molmo2Adapter().visual_items(config, ids)
    assert [(item.size, item.modality) for item in items] == [(10, "image"), (6, "image"), (6, "image")] + [
        (4, "video")
    ] * 2
    assert [int(ids[0, item.separator]) for item in items] == [8, IM_START_ID, 9, 6, 10]
    assert [int(ids[0, item.separator - 1]) for item in items] == [IM_END_ID] * 3 + [FRAME_END_ID] * 2
    check_items(items, ids, IM_PATCH_ID)


def test_molmo2_an_image_of_one_view_is_refused(molmo2):
    config = molmo2.config
    with pytest.raises(ValueError, match="has one view"):
        Molmo2Adapter().visual_items(config, torch.tensor([[BOS_ID, *view_ids(LOW_RES_START_ID, (2, 2)), 7]]))
    two_low = [BOS_ID, *view_ids(LOW_RES_START_ID, (2, 2)), *molmo2_image_ids((1, 2))]
    with pytest.raises(ValueError, match="has one view"):
        Molmo2Adapter().visual_items(config, torch.tensor([two_low]))
    with pytest.raises(ValueError, match="no view marker before it"):
        Molmo2Adapter().visual_items(config, torch.tensor([[BOS_ID, IM_PATCH_ID, IM_PATCH_ID, 7]]))


def test_molmo2_pruning_keeps_the_bidirectional_image_block(molmo2):
    """Given ``mm_token_type_ids``, every image token of a row attends to every other at prefill: the
    pruned model equals the reference that keeps transformers' mask (the block) and hides the pruned
    columns, and differs from the causal masked reference (the block matters: a negative control)."""
    batch = molmo2_multi_image_batch(molmo2, 2)
    with priortr.apply(molmo2, budget=0.4, layer=1) as handle, torch.no_grad():
        logits = molmo2(**batch.kwargs()).logits
        out = generate(molmo2, batch)
    result = handle.last
    stages = stage_masks(batch, result)
    with reference_for(molmo2, stages, batch.attention_mask), torch.no_grad():
        reference, real = kept_rows(molmo2(**batch.kwargs()).logits, result, batch)
        expected = generate(molmo2, batch)
    torch.testing.assert_close(logits[real], reference[real], atol=logits_atol(molmo2), rtol=0)
    assert torch.equal(out.sequences, expected.sequences)
    with staged_reference(molmo2, stages, batch.attention_mask), torch.no_grad():
        causal, _ = kept_rows(molmo2(**batch.kwargs()).logits, result, batch)
    assert (causal[real] - logits[real]).abs().max() > 1e-6


def test_molmo2_olmo_qk_norms_reproduce_the_attention_weights():
    """With ``qk_norm_type="olmo"`` the q/k norms act on the whole projection before the split into heads:
    ``queries_and_keys`` with RoPE equals the eager weights of every layer; without the norms it does not."""
    model = tiny_molmo2(attn="eager", qk_norm="olmo")
    adapter = adapter_for(model)
    batch = molmo2_batch(model, 1)
    captured: dict[int, dict] = {index: {} for index in range(len(adapter.decoder_layers(model)))}
    handles = []
    for index, store in captured.items():
        attention = adapter.attention(adapter.decoder_layers(model)[index])

        def inputs(module, args, kwargs, store=store):
            store["rope"], store["mask"] = kwargs["position_embeddings"], kwargs["attention_mask"]

        handles += [
            attention.register_forward_pre_hook(inputs, with_kwargs=True),
            attention.register_forward_hook(lambda m, a, out, store=store: store.update(weights=out[1])),
            attention.q_proj.register_forward_hook(lambda m, a, out, store=store: store.update(q=out)),
            attention.k_proj.register_forward_hook(lambda m, a, out, store=store: store.update(k=out)),
        ]
    try:
        with torch.no_grad():
            model(**batch.kwargs())
    finally:
        for handle in handles:
            handle.remove()
    for index, store in captured.items():
        attention = adapter.attention(adapter.decoder_layers(model)[index])

        def weights(queries, keys, attention=attention, store=store):
            q, k = (adapter.rotate(attention, x, store["rope"]) for x in (queries, keys))
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scores = q @ k.transpose(-1, -2) * adapter.scaling(attention) + store["mask"]
            return scores.softmax(-1, dtype=torch.float32).to(scores.dtype)

        queries, keys = adapter.queries_and_keys(attention, store["q"], store["k"])
        torch.testing.assert_close(weights(queries, keys), store["weights"], atol=1e-6, rtol=0)
        plain = FamilyAdapter.queries_and_keys(adapter, attention, store["q"], store["k"])
        assert (weights(*plain) - store["weights"]).abs().max() > 1e-4


def test_molmo2_input_norm_follows_norm_after(molmo2):
    adapter = adapter_for(molmo2)
    layer = adapter.decoder_layers(molmo2)[0]
    assert adapter.input_norm(layer) is layer.input_layernorm
    layer.norm_after = True
    try:
        assert isinstance(adapter.input_norm(layer), torch.nn.Identity)
    finally:
        layer.norm_after = False


# ---- both ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["minicpm-v-4.6", "minicpm-v-4.7", "molmo2"])
@pytest.mark.parametrize("new_tokens_only", [False, True])
def test_second_turn_on_pruned_cache_matches_the_reference(family, new_tokens_only):
    """Turn 1 prunes; turn 2 continues on the pruned cache (the check every multi-turn family runs)."""
    test_equivalence.test_second_turn_on_pruned_cache_matches_masked_reference(family, new_tokens_only)


def test_minicpmv_prior_and_posterior_are_the_scored_layers_own_attention():
    """Q, P and FastV's last row at full-attention layer 1 equal those read off its eager attention weights
    (the check the families with other layer kinds run)."""
    test_local_and_linear_attention.test_prior_and_posterior_are_the_scored_layers_own_attention(
        "minicpm-v-4.6", 1
    )


def test_molmo2_prior_and_posterior_are_the_scored_layers_own_attention():
    """With the bidirectional image block, Q and P at layer 1 equal those read off its eager attention
    weights (head mean) at the separator after ``<im_end>`` and the text rows from it on. The ``<im_col>``
    right after the last patch is a block row (it attends to the ``<im_end>`` after it), which a causal
    recomputation could not reproduce: why the separator is not there."""
    eager = tiny_molmo2(attn="eager", dtype=torch.float32)
    batch = molmo2_batch(eager, 2)
    weights = test_local_and_linear_attention._attention_weights(eager, 1, batch).mean(dim=1)  # [B, S, S]
    model = tiny_molmo2(dtype=torch.float32)
    with priortr.apply(model, method="fastv", budget=batch.n_visual, layer=1) as handle, torch.no_grad():
        model(**batch.kwargs())
    result = handle.last
    items = adapter_for(model).visual_items(model.config, batch.input_ids)
    for item in items:
        row, visual, separator = item.row, item.positions, item.separator
        rows = [r for r in range(separator, batch.seq_len) if batch.attention_mask[row, r]]
        prior, posterior = weights[row, separator, visual], weights[row][rows][:, visual].mean(dim=0)
        torch.testing.assert_close(result.prior[row], prior / prior.sum(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result.posterior[row], posterior / posterior.sum(), atol=1e-6, rtol=1e-5)
        column = int(visual[-1]) + 1
        assert weights[row, column, column + 1] > 1e-3  # a block row: <im_col> sees the later <im_end>
