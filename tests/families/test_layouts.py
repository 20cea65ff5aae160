"""Every family on every prompt layout it takes (ragged rows, tiles, videos, several images per
prompt): physical pruning equals the staged masked reference (tests/helpers/oracle.py) in float64, a budget
covering every token is the stock model, and the cache holds text + kept tokens."""

from __future__ import annotations

import pytest
import torch

import priortr
from priortr.tools import bench
from tests.helpers.families import (
    FAMILIES,
    LAYOUTS,
    skip_gemma4_static_window_before_checked,
    skip_unless_stock_runs_static,
)
from tests.helpers.pruned import assert_matches_reference, generate

LAYER = 1  # the tiny Qwen3-VL injects DeepStack features into layers 0 and 1

CASES = [(family, layout) for family, layouts in LAYOUTS.items() for layout in layouts]


def _build(family: str, layout: str, batch_size: int = 2):
    model = FAMILIES[family][0]()
    return model, LAYOUTS[family][layout](model, batch_size)


@pytest.mark.parametrize(("family", "layout"), CASES)
@pytest.mark.parametrize(("budget", "multi_image"), [(0.4, "per_image"), (5, "per_image"), (5, "global")])
def test_layout_matches_the_masked_reference(family, layout, budget, multi_image):
    model, batch = _build(family, layout)
    with (
        priortr.apply(model, budget=budget, layer=LAYER, multi_image=multi_image) as handle,
        torch.no_grad(),
    ):
        logits = model(**batch.kwargs()).logits
        result = handle.last
        out = generate(model, batch)
    visual = batch.visual_mask()
    assert result.n_visual.tolist() == visual.sum(dim=1).tolist()
    kept = (result.kept >= 0).sum(dim=1)
    assert torch.equal(result.stages[0].kept_mask(batch.seq_len) & ~visual, torch.zeros_like(visual))
    if multi_image == "global":
        assert torch.equal(kept, torch.clamp(result.n_visual, max=budget))
    elif isinstance(budget, int):
        assert bool((kept >= torch.clamp(result.n_visual, max=budget)).all())
    physical = int((batch.seq_len - result.n_visual + kept).max())
    assert logits.shape[1] == physical
    assert int(out.past_key_values.get_seq_length()) == physical + out.sequences.shape[1] - batch.seq_len - 1
    assert_matches_reference(model, batch, result, logits, out)


RAGGED = [family for family, layouts in LAYOUTS.items() if "ragged" in layouts]


@pytest.mark.parametrize("family", RAGGED)
def test_ragged_rows_decode_on_a_static_cache_as_the_reference(family):
    """Rows pruned to different lengths (fillers) decoded on a static cache, whose window layers
    (Gemma 3's sliding, Llama 4's chunked) keep fewer slots than the pruned prompt."""
    model, batch = _build(family, "ragged")
    skip_unless_stock_runs_static(model)
    skip_gemma4_static_window_before_checked(model)
    with priortr.apply(model, budget=0.4, layer=LAYER) as handle, torch.no_grad():
        logits = model(**batch.kwargs()).logits
        result = handle.last
        out = generate(model, batch, cache_implementation="static")
    assert bool(result.padding.any()), "the rows must be pruned to different lengths"
    assert_matches_reference(model, batch, result, logits, out, cache_implementation="static")


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_layout_with_a_budget_covering_every_token_is_the_stock_model(family, layout):
    model, batch = _build(family, layout)
    with torch.no_grad():
        stock = model(**batch.kwargs()).logits
    with priortr.apply(model, budget=int(batch.visual_mask().sum()), layer=LAYER) as handle, torch.no_grad():
        assert torch.equal(model(**batch.kwargs()).logits, stock)
    assert not handle.last.pruned


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("llava", "qwen2-vl", "qwen2.5-vl")])
def test_bench_runs_on_the_family_and_measures_the_expected_cache(family):
    """``priortr bench`` builds a realistic prompt from ``families.dummy_inputs`` and the pruned
    cache it measures holds exactly the text plus the kept tokens."""
    model = FAMILIES[family][0](dtype=torch.float32)
    if family.startswith("gemma4"):  # per-layer head sizes, per-layer inputs, shared keys: not counted
        with pytest.raises(ValueError, match="FLOPs and KV-cache count does not model gemma4_text"):
            bench.run_bench(model, ["vanilla"], [8], [1], layer=LAYER, text_tokens=12, new_tokens=2)
        return
    report = bench.run_bench(
        model,
        ["vanilla", "priortr"],
        [8],
        [1],
        layer=LAYER,
        text_tokens=12,
        new_tokens=2,
        warmup=0,
        repeats=1,
        decode_repeats=1,
    )
    vanilla, pruned = report.cases
    assert pruned.kv_cache_bytes == pruned.kv_cache_expected_bytes < vanilla.kv_cache_bytes
