"""Mistral 3's row breaks and GLM-4.1V's frames and 3-D RoPE, against the stock models' own layout.

Each check reads what the stock model does (where it scatters image features, the M-RoPE ids of
``get_rope_index``), so a transformers change to any of these facts fails here first.
"""

from __future__ import annotations

import pytest
import torch

import priortr
from priortr.adapters.glm4v import Glm4vAdapter
from priortr.adapters.mistral3 import Mistral3Adapter
from priortr.tools import families
from tests.helpers.tiny import language_model_inputs
from tests.helpers.tiny_glm4v import (
    GLM_IMAGE_END_ID,
    glm4v_batch,
    glm4v_multi_image_batch,
    glm4v_video_batch,
    tiny_glm4v,
)
from tests.helpers.tiny_mistral3 import (
    MISTRAL3_BREAK_ID,
    MISTRAL3_END_ID,
    TOKEN_PIXELS,
    mistral3_multi_image_batch,
    mistral3_ragged_batch,
    tiny_mistral3,
)


def _features_scattered_at(model, batch) -> torch.Tensor:
    """[B, S] True where the stock model wrote image features into the input embeddings."""
    seen = language_model_inputs(model, batch)
    text = model.get_input_embeddings()(batch.input_ids)
    return (seen["inputs_embeds"] - text).abs().amax(-1) > 0


@pytest.mark.parametrize("layout", [mistral3_ragged_batch, mistral3_multi_image_batch])
def test_mistral3_items_are_the_images_feature_positions_closed_by_img_end(layout):
    """An item is one image: exactly the positions the model scatters its features to (row breaks
    excluded), ``rows`` runs of ``cols`` tokens as ``image_sizes`` says, separated by one ``[IMG_BREAK]``,
    and its separator is the ``[IMG_END]`` right after its last token."""
    model = tiny_mistral3()
    batch = layout(model, 3)
    ids = batch.input_ids
    items = Mistral3Adapter().visual_items(model.config, ids)
    scattered = _features_scattered_at(model, batch)
    covered = torch.zeros_like(scattered)
    sizes = iter(batch.extra["image_sizes"].tolist())
    for item in items:
        covered[item.row, item.positions] = True
        height, width = next(sizes)
        rows, cols = height // TOKEN_PIXELS, width // TOKEN_PIXELS
        assert item.size == rows * cols and ids[item.row, item.separator] == MISTRAL3_END_ID
        first = int(item.positions[0])
        span = ids[item.row, first : item.separator + 1]
        assert (span.view(rows, cols + 1)[:, cols][:-1] == MISTRAL3_BREAK_ID).all()
    assert torch.equal(covered, scattered)
    assert next(sizes, None) is None


def test_mistral3_pruning_keeps_every_row_break():
    """Row breaks and end markers are text: every one of them is still in the pruned sequence."""
    model = tiny_mistral3()
    batch = mistral3_ragged_batch(model, 2)
    with priortr.apply(model, budget=3, layer=1) as handle, torch.no_grad():
        model(**batch.kwargs())
    positions = handle.last.positions
    markers = (batch.input_ids == MISTRAL3_BREAK_ID) | (batch.input_ids == MISTRAL3_END_ID)
    for row in range(2):
        kept = set(positions[row][~handle.last.padding[row]].tolist())
        assert set(markers[row].nonzero().flatten().tolist()) <= kept


def test_mistral3_an_image_without_its_end_marker_is_refused():
    model = tiny_mistral3()
    batch = mistral3_multi_image_batch(model, 1)
    ids = batch.input_ids.clone()
    ends = (ids[0] == MISTRAL3_END_ID).nonzero().flatten()
    ids[0, ends[-1]] = 5  # the second image runs into text: no [IMG_END] after its last row
    with pytest.raises(ValueError, match=r"not closed by \[IMG_END\]"):
        Mistral3Adapter().visual_items(model.config, ids)


def test_mistral3_visual_grid_reads_image_sizes():
    model = tiny_mistral3()
    batch = mistral3_ragged_batch(model, 2)
    assert families.visual_grid(Mistral3Adapter(), model.config, batch.kwargs(), 1) == (4, 5)


@pytest.mark.parametrize("layout", [glm4v_batch, glm4v_multi_image_batch, glm4v_video_batch])
def test_glm4v_items_are_the_placeholder_runs_with_their_3d_grids(layout):
    """Every ``<|image|>`` run is an item (an image, or one frame of a video, then of modality ``video``)
    closed by ``<|end_of_image|>``, and its ``get_rope_index`` ids are one raster grid: one temporal id,
    rows and columns counted from the item's first token."""
    model = tiny_glm4v()
    batch = layout(model, 2)
    items = Glm4vAdapter().visual_items(model.config, batch.input_ids)
    position_ids, _ = model.model.get_rope_index(
        batch.input_ids,
        mm_token_type_ids=batch.mm_token_type_ids,
        image_grid_thw=batch.image_grid_thw,
        video_grid_thw=batch.extra.get("video_grid_thw"),
        attention_mask=batch.attention_mask,
    )  # [3, B, S]
    assert torch.equal(
        torch.zeros_like(batch.visual_mask()).index_put_(
            (
                torch.cat([torch.full_like(i.positions, i.row) for i in items]),
                torch.cat([i.positions for i in items]),
            ),
            torch.tensor(True),
        ),
        batch.visual_mask(),
    )
    for item in items:
        assert batch.input_ids[item.row, item.separator] == GLM_IMAGE_END_ID
        types = batch.mm_token_type_ids[item.row, item.positions]
        assert (types == (2 if item.modality == "video" else 1)).all()
        t, h, w = position_ids[:, item.row, item.positions]
        assert t.unique().numel() == 1
        cols = int(w.max() - w.min()) + 1
        assert ((h - h.min()) * cols + (w - w.min())).tolist() == list(range(item.size))
    assert any(item.modality == "video" for item in items) == (layout is glm4v_video_batch)
