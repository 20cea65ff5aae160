"""Every method runs through the same engine: stages, pre-LLM pruning and merging, checked against
independent references (tests/helpers/oracle.py) on tiny random-weight models in float64.

Pure selections must equal the staged masked reference; merging must equal a reference that writes
the merged hidden states into the full sequence itself; a batch must equal its rows run one by one.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import priortr
from priortr.cli import main
from priortr.engine.attention import cls_attention
from priortr.engine.config import VISION_NEEDS, PruningConfig
from priortr.methods.recycling import recycle_counts
from priortr.methods.registry import DEFAULT_LAYER
from priortr.methods.selection import Selection, StageInputs
from tests.helpers.families import FAMILIES, setup
from tests.helpers.pruned import (
    NEW_TOKENS,
    conversation,
    generate,
    kept_rows,
    reference_for,
    row_alone,
    stage_masks,
)
from tests.helpers.tiny import Batch, llava_batch, tiny_llava
from tests.helpers.tiny_qwen3_vl import INJECTED_LAYERS as DEEPSTACK

SELECTIONS = [  # (family, method, budget, apply keywords): pure selections, so the oracle applies
    ("llava", "pdrop", 4, {}),
    ("qwen2.5-vl", "pdrop", 4, {}),
    ("llava", "pdrop+priortr", 4, {}),
    ("llava", "priortr", 5, {"stages": [(0, 10), (2, 5)]}),
    ("qwen2.5-vl", "fastv", 0.25, {"stages": [(1, 0.5), (2, 0.25)]}),
    ("llava", "divprune", 5, {}),
    ("qwen2.5-vl", "divprune", 5, {}),
    ("llava", "vispruner", 5, {}),
    ("llava", "dart", 5, {"layer": 1}),
    ("qwen2.5-vl", "dart", 5, {"layer": 1}),
]


@pytest.mark.parametrize(("family", "method", "budget", "extra"), SELECTIONS)
def test_selections_match_staged_reference(family, method, budget, extra):
    model, batch = setup(family, 2)
    budget_kw = {} if "stages" in extra else {"budget": budget}  # stages set every stage's budget
    with priortr.apply(model, method=method, **budget_kw, **extra) as handle, torch.no_grad():
        logits = model(**batch.kwargs()).logits
        result = handle.last
        out = generate(model, batch)
    k = result.kept.shape[1]
    assert k == priortr.engine.config.resolve_budget(budget, batch.n_visual)
    assert logits.shape[1] == batch.seq_len - batch.n_visual + k
    assert int(out.past_key_values.get_seq_length()) == batch.seq_len - batch.n_visual + k + NEW_TOKENS - 1
    for cache_layer in out.past_key_values.layers:  # text + K in every layer, whatever the stage
        assert cache_layer.keys.shape[2] == batch.seq_len - batch.n_visual + k + NEW_TOKENS - 1

    stages = stage_masks(batch, result)
    with reference_for(model, stages, batch.attention_mask), torch.no_grad():
        reference = model(**batch.kwargs()).logits
        expected_out = generate(model, batch)
    expected, real = kept_rows(reference, result, batch)
    torch.testing.assert_close(logits[real], expected[real], atol=1e-10, rtol=0)
    assert torch.equal(out.sequences, expected_out.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected_out.logits), atol=1e-10, rtol=0)

    later = [(layer + 1, pruned) for layer, pruned in stages]  # negative control: stages one layer late
    if all(layer < len(priortr.adapters.adapter_for(model).decoder_layers(model)) - 1 for layer, _ in later):
        with reference_for(model, later, batch.attention_mask), torch.no_grad():
            wrong, _ = kept_rows(model(**batch.kwargs()).logits, result, batch)
        assert (wrong[real] - logits[real]).abs().max() > 1e-6


@pytest.mark.parametrize(("family", "method"), [("llava", "pdrop"), ("qwen2.5-vl", "divprune")])
def test_static_cache_with_stages_matches_staged_reference(family, method):
    model, batch = setup(family, 2)
    static = {"cache_implementation": "static"}
    with priortr.apply(model, method=method, budget=4) as handle, torch.no_grad():
        out = generate(model, batch, **static)
    with reference_for(model, stage_masks(batch, handle.last), batch.attention_mask), torch.no_grad():
        expected = generate(model, batch, **static)
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), atol=1e-10, rtol=0)
    assert int(out.past_key_values.get_seq_length()) == batch.seq_len - batch.n_visual + 4 + NEW_TOKENS - 1


def _two_turns(model, batch: Batch, reference: bool = False):
    """Turn 1 on the batch, then turn 2: the whole conversation as input_ids on turn 1's cache (the
    reference, which keeps no cache, gets the whole conversation with its images)."""
    first = generate(model, batch)
    follow_up = torch.randint(10, 100, (batch.batch_size, 3), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([first.sequences, follow_up], dim=1)
    mask = torch.cat([batch.attention_mask, torch.ones_like(ids[:, batch.seq_len :])], dim=1)
    turn = (
        conversation(batch, ids, mask).kwargs() if reference else {"input_ids": ids, "attention_mask": mask}
    )
    return model.generate(
        **turn,
        past_key_values=first.past_key_values,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )


@pytest.mark.parametrize("method", ["pdrop", "divprune"])
def test_second_turn_on_a_cache_pruned_in_stages(method):
    model, batch = setup("llava", 2)
    with priortr.apply(model, method=method, budget=4) as handle, torch.no_grad():
        second = _two_turns(model, batch)
    with reference_for(model, stage_masks(batch, handle.last), batch.attention_mask), torch.no_grad():
        expected = _two_turns(model, batch, reference=True)
    assert torch.equal(second.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(second.logits), torch.stack(expected.logits), atol=1e-10, rtol=0)
    with torch.no_grad():
        stock = _two_turns(model, batch)
    assert (torch.stack(stock.logits) - torch.stack(second.logits)).abs().max() > 1e-6


def test_pdrop_runs_pyramid_drops_schedule():
    model, batch = setup("llava", 1)
    with priortr.apply(model, method="pdrop", budget=4) as handle, torch.no_grad():
        model(**batch.kwargs())
    stages = handle.last.stages
    assert [stage.layer for stage in stages] == [0, 1, 2]  # 4 layers: stages start at layers 1, 2, 3
    assert [stage.kept.shape[1] for stage in stages] == [10, 6, 4]  # 16 * (4/16)^(i/3), rounded
    for earlier, later in itertools.pairwise(stages):
        assert set(later.kept[0].tolist()) <= set(earlier.kept[0].tolist())
    assert priortr.methods.pdrop.pyramid_stages(64, 576, 32) == [(7, 277), (15, 133), (23, 64)]


_MERGE_WEIGHTS: dict[str, torch.Tensor] = {}


@priortr.register_method(
    "test-merge", where="layer", summary="test only: keeps the first K, merges pairs", source="tests"
)
def _test_merge(inputs: StageInputs) -> Selection:
    """Keep tokens 0..K-1; token K-1 also absorbs every dropped token (uniform weights)."""
    batch, n = inputs.hidden.shape[:2]
    k = inputs.budget
    merge = torch.zeros(batch, k, n, dtype=torch.float32)
    merge[:, torch.arange(k - 1), torch.arange(k - 1)] = 1.0
    merge[:, k - 1, k - 1 :] = 1.0 / (n - k + 1)
    _MERGE_WEIGHTS["last"] = merge
    return Selection(indices=torch.arange(k).expand(batch, k), merge=merge)


def test_merged_hidden_states_match_a_reference_that_writes_them():
    """Merging at layer L equals the full model with the merged states written into layer L's output
    (and the dropped tokens masked after L): checked in float64, prefill and generation."""
    layer, budget = 1, 5
    model, batch = setup("llava", 2)
    with priortr.apply(model, method="test-merge", budget=budget, layer=layer) as handle, torch.no_grad():
        logits = model(**batch.kwargs()).logits
        result = handle.last
        out = generate(model, batch)
    assert result.stages[0].merged
    merge = _MERGE_WEIGHTS["last"].double()

    def write_merged(module, args, output):
        """Layer L's output with the merged states written in (the reference runs the whole sequence,
        prompt and generated tokens, at every step)."""
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.shape[1] < batch.seq_len:
            return None
        hidden = hidden.clone()
        for row in range(batch.batch_size):
            start = batch.image_start[row]
            visual = hidden[row, start : start + batch.n_visual]
            hidden[row, start : start + budget] = merge[row] @ visual
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    hook = (
        priortr.adapters.adapter_for(model).decoder_layers(model)[layer].register_forward_hook(write_merged)
    )
    try:
        with reference_for(model, stage_masks(batch, result), batch.attention_mask), torch.no_grad():
            reference = model(**batch.kwargs()).logits
            expected_out = generate(model, batch)
    finally:
        hook.remove()
    expected, real = kept_rows(reference, result, batch)
    torch.testing.assert_close(logits[real], expected[real], atol=1e-10, rtol=0)
    assert torch.equal(out.sequences, expected_out.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected_out.logits), atol=1e-10, rtol=0)

    with reference_for(model, stage_masks(batch, result), batch.attention_mask), torch.no_grad():
        unmerged, _ = kept_rows(model(**batch.kwargs()).logits, result, batch)
    assert (unmerged[real] - logits[real]).abs().max() > 1e-6, "merging must change the outputs"


def _first_layer(method: str) -> int:
    """The first stage's layer of ``method`` on the 4-layer tiny models (-1: before the LLM)."""
    config = PruningConfig(method=priortr.get_method(method), budget=6, layer=DEFAULT_LAYER)
    return config.schedule(16, 4)[0][0]


HYBRID = ("qwen3.5", "qwen3.5-moe", "minicpm-v-4.6", "minicpm-v-4.7")
"""Families with linear-attention layers: on the tiny models only layer 1 can be scored, so one-layer
methods score it there and methods that score several layers cannot run (refusal tested in
tests/families/test_local_and_linear_attention.py)."""


KV_SHARED = ("gemma4-e2b",)
"""Families whose last layers read an earlier layer's keys (Gemma 4's E2B/E4B shape): they cannot be
scored, so PyramidDrop's default schedule, which ranks with the layer after each stage's, is refused on
the tiny model (tested in tests/families/test_gemma4.py)."""


GRID_FAMILIES = (
    *("llava", "video-llava", "qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "glm4v"),
    *("llava-onevision-1.5", "glm46v", "glm46v-moe", "qwen3.5", "qwen3.5-moe"),
)
"""Families whose adapter lays an image's tokens on a grid (``token_grids``), for CLSE and downsample (the
refusals elsewhere: tests/methods/test_methods_clse.py, test_methods_downsample.py)."""
POOLED = 4
"""Tokens downsample leaves of every grid family's tiny image for K = 6: 4 x 4 and 3 x 4 grids pool to
2 x 2."""


def _cases() -> list[tuple[str, str]]:
    """Every method on every family that can run it: [CLS] methods need a tower with [CLS] (LLaVA,
    Video-LLaVA images), CLSE a token grid; Qwen3-VL refuses stages before its last DeepStack layer
    (tested below)."""
    cases = []
    for method in priortr.available_methods():
        if method == "test-merge":
            continue
        info = priortr.get_method(method)
        if info.needs & VISION_NEEDS:
            families = ["llava", "video-llava"]
        else:
            families = [
                f
                for f in FAMILIES
                if not (f.startswith("qwen3-vl") and _first_layer(method) < DEEPSTACK - 1)
                and not (f in HYBRID and info.where == "layers")
                and not (f in KV_SHARED and "next_attention" in info.needs)
                and ("grid" not in info.needs or f in GRID_FAMILIES)
            ]
        cases += [(family, method) for family in families]
    return cases


def _survivors(method: str, stages: list[tuple[int, int]], n_visual: int) -> int:
    """Visual tokens left after ``stages``: the last count, or for SparseVLM (the authors' default) each
    stage's count plus the clusters it recycles on top, or downsample's pooled grid."""
    if method == "downsample":
        return POOLED
    if method != "sparsevlm":
        return stages[-1][1]
    for _, count in stages:
        if count < n_visual:
            n_visual = count + recycle_counts(n_visual - count, 0.3, 10)[1]
    return n_visual


@pytest.mark.parametrize(("family", "method"), _cases())
def test_every_method_keeps_exactly_k_and_a_batch_equals_its_rows(family, method):
    model, batch = setup(family, 2)
    budget = 6
    layer = {"layer": 1} if family in HYBRID and priortr.get_method(method).where == "layer" else {}
    # The stock model's own batch-vs-row noise (Gemma 3: ~1.5e-7 in float64, its float32 RoPE angles of
    # left-padded rows' absolute positions) bounds how closely a pruned batch can match its rows.
    with torch.no_grad():
        stock = model(**batch.kwargs()).logits[:, -1]
        noise = max((model(**row_alone(batch, r)).logits[0, -1] - stock[r]).abs().max() for r in range(2))
    tolerance = max(1e-7, 4 * float(noise))
    with priortr.apply(model, method=method, budget=budget, **layer) as handle, torch.no_grad():
        logits = model(**batch.kwargs()).logits[:, -1]
        kept = handle.last.kept - handle.last.visual_start[:, None]
        n_layers = len(priortr.adapters.adapter_for(model).decoder_layers(model))
        survivors = _survivors(method, handle.config.schedule(batch.n_visual, n_layers), batch.n_visual)
        assert kept.shape[1] == (survivors - 1 if method == "visionzip" else survivors)
        if priortr.get_method(method).schedule is None:  # VisionZip's [CLS] takes one of its K slots
            expected = {"visionzip": budget - 1, "downsample": POOLED}.get(method, budget)
            assert kept.shape[1] == expected
        for row in range(batch.batch_size):
            alone = model(**row_alone(batch, row)).logits[:, -1]
            assert torch.equal(handle.last.kept - handle.last.visual_start[:, None], kept[row : row + 1])
            torch.testing.assert_close(alone[0], logits[row], atol=tolerance, rtol=0)


@pytest.mark.parametrize("method", sorted(set(priortr.available_methods()) - {"test-merge"}))
def test_budget_covering_every_token_is_the_stock_model(method):
    family = "llava"
    model, batch = setup(family, 2)
    with torch.no_grad():
        stock = model(**batch.kwargs()).logits
    with priortr.apply(model, method=method, budget=batch.n_visual) as handle, torch.no_grad():
        pruned = model(**batch.kwargs()).logits
    assert torch.equal(stock, pruned)
    assert not handle.last.pruned


def test_vision_cls_attention_equals_the_towers_own_weights():
    model = tiny_llava(attn="eager")
    batch = llava_batch(model, batch_size=2)
    probe = priortr.adapters.adapter_for(model).vision_probe(model)
    captured = {}
    hooks = [
        probe.query_projection.register_forward_hook(lambda m, a, out: captured.__setitem__("q", out)),
        probe.key_projection.register_forward_hook(lambda m, a, out: captured.__setitem__("k", out)),
    ]
    try:
        with torch.no_grad():
            tower = model.model.vision_tower(batch.pixel_values, output_attentions=True)
    finally:
        for hook in hooks:
            hook.remove()
    cls, keys = cls_attention(captured["q"], captured["k"], probe.heads, probe.scaling, probe.first_token)
    layer = model.config.vision_feature_layer % (len(tower.attentions) + 1) - 1
    expected = tower.attentions[layer][:, :, 0, 1:].mean(dim=1)  # [B, N]
    torch.testing.assert_close(cls, expected.to(cls.dtype), atol=1e-6, rtol=0)
    assert cls.shape == (2, batch.n_visual) and keys.shape[2] == batch.n_visual
    wrong = tower.attentions[layer - 1 if layer else layer + 1][:, :, 0, 1:].mean(dim=1)
    assert (wrong.to(cls.dtype) - cls).abs().max() > 1e-4, "another layer's attention must differ"


def test_methods_refuse_what_they_cannot_do():
    qwen, _ = setup("qwen2.5-vl", 1)
    for method in ("visionzip", "vispruner", "prumerge"):
        with pytest.raises(ValueError, match=r"\[CLS\]"):
            priortr.apply(qwen, method=method)
    llava, _ = setup("llava", 1)
    with pytest.raises(ValueError, match="takes no layer"):
        priortr.apply(llava, method="visionzip", layer=2)
    with pytest.raises(ValueError, match="takes no stages"):
        priortr.apply(llava, method="divprune", stages=[(1, 4)])
    with pytest.raises(ValueError, match="has no option"):
        priortr.apply(llava, method="priortr", options={"pivots": 3})
    with pytest.raises(ValueError, match="strictly increasing"):
        priortr.apply(llava, method="priortr", stages=[(2, 8), (1, 4)])
    with pytest.raises(ValueError, match="must not increase"):
        priortr.apply(llava, method="priortr", stages=[(0, 4), (1, 8)])


def test_methods_command_lists_every_method(capsys):
    assert main(["methods", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["name"] for row in rows} == set(priortr.available_methods())
    where = {row["name"]: row["where"] for row in rows}
    assert where["visionzip"] == "before the LLM"
    assert where["pdrop"] == "after several decoder layers"
    assert where["priortr"] == "after decoder layer L"
    # before: knobs were one formatted string and the default layer was missing
    info = {row["name"]: row for row in rows}
    assert {name: row["default_layer"] for name, row in info.items()} == {
        name: priortr.get_method(name).default_layer for name in priortr.available_methods()
    }
    assert (info["fastv"]["default_layer"], info["priortr"]["default_layer"]) == (1, 2)
    assert info["visionzip"]["default_layer"] is None
    assert info["priortr+merge"]["knobs"] == {
        "adaptive": False,
        "recycle_ratio": 0.3,
        "tokens_per_cluster": 10,
        "clustering": "kmeans",
    }
    assert main(["methods"]) == 0
    listing = capsys.readouterr().out
    assert "PyramidDrop" in listing and "after decoder layer L (default 1)  FastV" in listing


def test_the_layer_help_gives_each_method_its_own_default(capsys):
    """Before: ``generate --help`` said --layer defaults to 2, while FastV and DART score layer 1."""
    assert main(["generate", "--help"]) == 0
    assert "1 for dart, fastv; 2 for the others" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("method", "keywords"),
    [("divprune", {}), ("pdrop", {}), ("priortr", {"layer": 0}), ("fastv", {"stages": [(0, 8), (2, 4)]})],
)
def test_deepstack_refuses_pruning_before_the_last_injection(method, keywords):
    model, batch = setup("qwen3-vl", 1)
    with pytest.raises(ValueError, match="DeepStack"):
        priortr.apply(model, method=method, **keywords)
    with priortr.apply(model, method="priortr", budget=4, layer=DEEPSTACK - 1) as handle, torch.no_grad():
        model(**batch.kwargs())
    assert handle.last.stages[0].layer == DEEPSTACK - 1 and handle.last.pruned
