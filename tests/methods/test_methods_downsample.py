"""Downsample: its grid rule and pooled values by hand, against torch's adaptive average pooling, and
its pruned prefill and generation against a reference that pools the input embeddings itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import priortr
from priortr.methods.downsample import downsample, pooled_grid
from priortr.methods.selection import StageInputs
from tests.helpers.families import setup
from tests.helpers.pruned import generate, kept_rows, reference_for, stage_masks


def _inputs(hidden: torch.Tensor, budget: int, grids) -> StageInputs:
    return StageInputs(budget=budget, hidden=hidden, grids=tuple(grids))


@pytest.mark.parametrize(
    ("grid", "budget", "expected"),
    [
        ((24, 24), 192, (13, 13)),  # the testbed's and LLaVA-1.5's grid: 169 tokens
        ((24, 24), 128, (11, 11)),
        ((24, 24), 64, (8, 8)),
        ((24, 24), 32, (5, 5)),
        ((3, 4), 6, (2, 2)),  # s = sqrt(1/2): 3 s = 2.12, 4 s = 2.83
        ((12, 18), 64, (6, 9)),  # sqrt(64 * 12 / 18) = 6.5, sqrt(64 * 18 / 12) = 9.8
        ((1, 100), 4, (1, 4)),  # a one-row grid keeps its row
        ((100, 1), 4, (4, 1)),
        ((4, 4), 16, (4, 4)),  # K >= N: the whole grid
        ((4, 4), 1, (1, 1)),
    ],
)
def test_the_pooled_grid_keeps_the_aspect_and_at_most_k(grid, budget, expected):
    assert pooled_grid(*grid, budget) == expected
    assert expected[0] * expected[1] <= max(budget, grid[0] * grid[1])


def test_pooled_values_and_slots_by_hand():
    """A 3 x 3 grid of values 10 i + j to 2 x 2: windows [0, 2) and [1, 3) per side (they overlap), so
    the means are 5.5, 6.5, 15.5, 16.5 and the slots the windows' first middles, tokens 0, 1, 3, 4."""
    hidden = torch.tensor([10.0 * i + j for i in range(3) for j in range(3)], dtype=torch.float64)
    selection = downsample(_inputs(hidden[None, :, None], 4, [(3, 3)]))
    assert selection.indices.tolist() == [[0, 1, 3, 4]]
    pooled = selection.merge[0] @ hidden
    assert pooled.tolist() == [5.5, 6.5, 15.5, 16.5]
    # a 4 x 4 grid to 2 x 2: disjoint 2 x 2 windows, slots at each window's top-left middle
    assert downsample(_inputs(torch.randn(1, 16, 3), 4, [(4, 4)])).indices.tolist() == [[0, 2, 8, 10]]


@pytest.mark.parametrize(("grid", "budget"), [((5, 7), 12), ((6, 4), 9), ((7, 7), 20), ((2, 9), 5)])
def test_merge_rows_are_torchs_adaptive_average_pooling(grid, budget):
    height, width = grid
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, height * width, 3, dtype=torch.float64, generator=generator)
    selection = downsample(_inputs(hidden, budget, [grid, grid]))
    rows, cols = pooled_grid(height, width, budget)
    images = hidden.transpose(1, 2).reshape(2, 3, height, width)
    expected = F.adaptive_avg_pool2d(images, (rows, cols)).reshape(2, 3, -1).transpose(1, 2)
    torch.testing.assert_close(selection.merge @ hidden, expected, atol=1e-12, rtol=0)
    assert selection.indices.shape == (2, rows * cols)
    assert bool((selection.indices[:, 1:] > selection.indices[:, :-1]).all())


def test_refuses_missing_or_mismatched_grids():
    hidden = torch.randn(2, 12, 3)
    with pytest.raises(ValueError, match="give every image its grid"):
        downsample(StageInputs(budget=4, hidden=hidden))
    with pytest.raises(ValueError, match="3 x 3 grid does not hold 12"):
        downsample(_inputs(hidden, 4, [(3, 4), (3, 3)]))
    with pytest.raises(ValueError, match="one per batch"):  # 3 x 4 pools to 2 x 3, 2 x 6 to 1 x 4
        downsample(_inputs(hidden, 8, [(3, 4), (2, 6)]))


def _pooling_reference(model, batch, grid: tuple[int, int], budget: int):
    """A pre-hook on the language model that writes, into every row's visual span of the input embeddings,
    the grid average-pooled by torch at the slots the rule names (the middles of the windows), which the
    staged reference keeps while it hides the other visual columns from every layer."""
    rows, cols = pooled_grid(*grid, budget)
    height, width = grid

    def middles(size: int, out: int) -> list[int]:
        return [(i * size // out + -(-(i + 1) * size // out) - 1) // 2 for i in range(out)]

    slots = [r * width + c for r in middles(height, rows) for c in middles(width, cols)]

    def write_pooled(module, args, kwargs):
        embeds = kwargs["inputs_embeds"]
        if embeds.shape[1] < batch.seq_len:
            return None
        embeds = embeds.clone()
        for row, start in enumerate(batch.image_start):
            visual = embeds[row, start : start + height * width]  # [N, D]
            image = visual.T.reshape(1, -1, height, width)
            pooled = F.adaptive_avg_pool2d(image, (rows, cols)).reshape(-1, rows * cols).T
            embeds[row, [start + slot for slot in slots]] = pooled
        return args, {**kwargs, "inputs_embeds": embeds}

    language_model = priortr.adapters.adapter_for(model).language_model(model)
    return language_model.register_forward_pre_hook(write_pooled, with_kwargs=True)


@pytest.mark.parametrize(("family", "grid"), [("llava", (4, 4)), ("qwen2.5-vl", (3, 4))])
def test_pruned_generate_equals_a_reference_that_pools_the_embeddings(family, grid):
    """LLaVA's 4 x 4 patch grid and Qwen2.5-VL's merged 3 x 4 grid, budget 6: 2 x 2 pooled tokens reach the
    LLM; the prefill and greedy generation equal the full model whose visual embeddings are pooled by
    torch and whose other visual columns are masked. Negative control: the same masks without the
    pooled embeddings (the slots' own) differ."""
    model, batch = setup(family, 2)
    assert batch.n_visual == grid[0] * grid[1]
    with priortr.apply(model, method="downsample", budget=6) as handle, torch.no_grad():
        logits = model(**batch.kwargs()).logits
        result = handle.last
        out = generate(model, batch)
    assert result.kept.shape[1] == 4 and result.stages[0].layer == -1 and result.stages[0].merged
    stages = stage_masks(batch, result)
    hook = _pooling_reference(model, batch, grid, 6)
    try:
        with reference_for(model, stages, batch.attention_mask), torch.no_grad():
            reference = model(**batch.kwargs()).logits
            expected_out = generate(model, batch)
    finally:
        hook.remove()
    expected, real = kept_rows(reference, result, batch)
    torch.testing.assert_close(logits[real], expected[real], atol=1e-10, rtol=0)
    assert torch.equal(out.sequences, expected_out.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected_out.logits), atol=1e-10, rtol=0)

    with reference_for(model, stages, batch.attention_mask), torch.no_grad():
        unpooled, _ = kept_rows(model(**batch.kwargs()).logits, result, batch)
    assert (unpooled[real] - logits[real]).abs().max() > 1e-6, "pooling must change the outputs"


def test_families_without_one_grid_per_image_are_refused_with_the_reason():
    for family, reason in [
        ("llava-next", "AnyRes image is two grids"),
        ("internvl", "several tiles and a thumbnail"),
        ("smolvlm", "several sub-images and a global view"),
    ]:
        model, _ = setup(family, 1)
        with pytest.raises(ValueError, match=reason):
            priortr.apply(model, method="downsample", budget=4)
    llava, _ = setup("llava", 1)
    with pytest.raises(ValueError, match="multi_image='per_image'"):
        priortr.apply(llava, method="downsample", multi_image="global")
    with pytest.raises(ValueError, match="takes no layer"):
        priortr.apply(llava, method="downsample", layer=1)
