"""Several images per prompt and ragged batches (rows with different visual-token counts or budgets)
through the one engine: equal to the staged masked reference (tests/helpers/oracle.py) and to each row run on
its own, in float64 on tiny random-weight models."""

from __future__ import annotations

import pytest
import torch

import priortr
from priortr.engine.config import split_count
from tests.helpers.oracle import staged_reference
from tests.helpers.pruned import assert_matches_reference, conversation, generate, row_alone, stage_masks
from tests.helpers.tiny import llava_batch, qwen_batch, tiny_llava, tiny_qwen2_5_vl

RAGGED_GRIDS = [(1, 4, 4), (1, 4, 8), (1, 8, 8)]  # 4, 8 and 16 visual tokens


@pytest.mark.parametrize(
    ("method", "budget", "kept"),
    [
        ("priortr", 3, [3, 3, 3]),
        ("fastv", 0.5, [2, 4, 8]),
        ("pdrop", 0.25, [1, 2, 4]),
        ("divprune", 6, [4, 6, 6]),
    ],
)
def test_ragged_batch_equals_reference_and_each_row_alone(method, budget, kept):
    model = tiny_qwen2_5_vl()
    batch = qwen_batch(model, batch_size=3, grid=RAGGED_GRIDS)
    with priortr.apply(model, method=method, budget=budget) as handle, torch.no_grad():
        logits = model(**batch.kwargs()).logits
        result = handle.last
        out = generate(model, batch)
        alone = [model(**row_alone(batch, row)).logits[0] for row in range(3)]
    assert (result.kept >= 0).sum(dim=1).tolist() == kept
    assert result.n_visual.tolist() == [4, 8, 16]
    lengths = batch.seq_len - result.n_visual + torch.tensor(kept)  # left padding included
    assert logits.shape[1] == int(lengths.max())
    assert bool(result.padding.any()), "rows of different lengths must be padded with masked tokens"
    assert_matches_reference(model, batch, result, logits, out)
    real = batch.attention_mask.gather(1, result.positions).bool() & ~result.padding
    for row in range(3):
        assert alone[row].shape[0] == int(real[row].sum())
        torch.testing.assert_close(alone[row], logits[row, real[row]], atol=1e-7, rtol=0)


@pytest.mark.parametrize("multi_image", ["per_image", "global"])
def test_two_images_per_prompt_equal_the_reference(multi_image):
    model = tiny_llava()
    batch = llava_batch(model, batch_size=2, images=2)
    with (
        priortr.apply(model, budget=8, layer=1, multi_image=multi_image) as handle,
        torch.no_grad(),
    ):
        logits = model(**batch.kwargs()).logits
        result = handle.last
        out = generate(model, batch)
    assert (result.kept >= 0).sum(dim=1).tolist() == [8, 8]
    visual = batch.visual_mask()
    first_image = torch.stack([row.nonzero().flatten()[:16] for row in visual])  # [B, 16]
    in_first = torch.isin(result.kept, first_image).sum(dim=1)
    prior_mass = result.prior.view(2, 2, 16).sum(dim=2)  # [B, image]
    if multi_image == "per_image":
        assert in_first.tolist() == [4, 4], "a count budget splits in proportion to each image's tokens"
        torch.testing.assert_close(prior_mass, torch.ones(2, 2), atol=1e-5, rtol=0)
    else:
        torch.testing.assert_close(prior_mass, torch.full((2, 2), 0.5), atol=1e-5, rtol=0)
        top = result.scores.topk(8, dim=1).indices.sort(dim=1).values
        positions = torch.stack([row.nonzero().flatten() for row in visual])
        assert torch.equal(positions.gather(1, top), result.kept), "one top-K over both images"
    assert_matches_reference(model, batch, result, logits, out)


def test_proportional_split_sums_to_the_budget():
    sizes = [4, 16, 9]
    total = sum(sizes)
    for count in range(6, 30):
        shares = [split_count(count, sum(sizes[:i]), size, total) for i, size in enumerate(sizes)]
        assert sum(shares) == count and all(share >= 1 for share in shares), (count, shares)
    shares = [split_count(3, sum(sizes[:i]), size, total) for i, size in enumerate(sizes)]
    assert shares == [1, 2, 1], "every image keeps at least one token, even past a tiny budget"
    assert [split_count(10, sum(sizes[:i]), s, 20) for i, s in enumerate([4, 16])] == [2, 8]


def test_ragged_pre_llm_pruning_with_a_second_turn_matches_the_reference():
    """Padding columns of a ragged batch stay masked in decode steps and in a later turn."""
    model = tiny_qwen2_5_vl()
    batch = qwen_batch(model, batch_size=2, grid=RAGGED_GRIDS[1:])
    with priortr.apply(model, method="divprune", budget=0.5) as handle, torch.no_grad():
        first = model.generate(
            **batch.kwargs(), max_new_tokens=2, do_sample=False, return_dict_in_generate=True
        )
        result = handle.last
        assert bool(result.padding.any())
        cache = first.past_key_values
        follow = torch.randint(3, 190, (2, 3), generator=torch.Generator().manual_seed(5))
        ids = torch.cat([first.sequences, follow], dim=1)
        mask = torch.cat(
            [batch.attention_mask, torch.ones(2, ids.shape[1] - batch.seq_len, dtype=torch.long)], 1
        )
        second = model.generate(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    with staged_reference(model, stage_masks(batch, result), batch.attention_mask), torch.no_grad():
        ref_first = model.generate(
            **batch.kwargs(), max_new_tokens=2, do_sample=False, return_dict_in_generate=True
        )
        ref_second = model.generate(
            **conversation(batch, ids, mask).kwargs(),
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(first.sequences, ref_first.sequences)
    assert torch.equal(second.sequences, ref_second.sequences)
    torch.testing.assert_close(torch.stack(second.logits), torch.stack(ref_second.logits), atol=1e-10, rtol=0)


def test_ragged_batch_with_a_static_cache_matches_the_reference():
    model = tiny_qwen2_5_vl()
    batch = qwen_batch(model, batch_size=3, grid=RAGGED_GRIDS)
    with priortr.apply(model, method="fastv", budget=0.5, layer=1) as handle, torch.no_grad():
        out = generate(model, batch, cache_implementation="static")
        result = handle.last
    assert bool(result.padding.any())
    with staged_reference(model, stage_masks(batch, result), batch.attention_mask), torch.no_grad():
        expected = generate(model, batch, cache_implementation="static")
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), atol=1e-10, rtol=0)


@pytest.mark.parametrize("multi_image", ["per_image", "global"])
def test_cls_ranked_method_reads_each_images_own_tower_output(multi_image):
    """VisPruner ranks by the tower's [CLS] attention: with two images per prompt each image's tokens
    are ranked by its own tower pass (the tower encodes the batch's images in prompt order)."""
    model = tiny_llava()
    batch = llava_batch(model, batch_size=2, images=2)
    with (
        priortr.apply(model, method="vispruner", budget=8, multi_image=multi_image) as handle,
        torch.no_grad(),
    ):
        logits = model(**batch.kwargs()).logits
        result = handle.last
        out = generate(model, batch)
    assert result.stages[0].layer == -1 and (result.kept >= 0).sum(dim=1).tolist() == [8, 8]
    assert_matches_reference(model, batch, result, logits, out)
    swapped = (
        batch.pixel_values.view(2, 2, *batch.pixel_values.shape[1:]).flip(1).reshape_as(batch.pixel_values)
    )
    with (
        priortr.apply(model, method="vispruner", budget=8, multi_image=multi_image) as handle,
        torch.no_grad(),
    ):
        model(**{**batch.kwargs(), "pixel_values": swapped})
    assert not torch.equal(handle.last.kept, result.kept), "the images' order must matter"
