"""Families whose decoder is not all full attention: what pruning means there, checked against the stock
model and the reference that runs each layer on the pruned sequence (``tests/helpers/pruned_reference.py``).

* Qwen3.5 (linear + full attention): only full-attention layers can be scored; the linear-attention states
  are left as they are (layers up to the scored one absorbed every token, later ones only the kept ones);
  only the full-attention caches shrink.
* Gemma 3 (sliding + global), Mistral with a window (all sliding): a window counts the prompt's own
  positions, at the scored layer, in the layers after it and in every decode step across its edge.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import priortr
from priortr import compat
from priortr.tools import overhead
from tests.helpers.families import (
    FAMILIES,
    skip_gemma4_static_window_before_checked,
    skip_unless_stock_runs_static,
)
from tests.helpers.pruned import generate, kept_rows, logits_atol, pruned_columns, reference_for, row_alone
from tests.helpers.tiny import Batch
from tests.helpers.tiny_gemma3 import LAYER_TYPES as GEMMA3_LAYER_TYPES
from tests.helpers.tiny_gemma3 import gemma3_batch, gemma3_ragged_batch, tiny_gemma3
from tests.helpers.tiny_gemma4 import gemma4_batch, gemma4_ragged_batch, tiny_gemma4, tiny_gemma4_e2b
from tests.helpers.tiny_llama4 import llama4_batch, tiny_llama4
from tests.helpers.tiny_mistral3 import mistral3_batch, mistral3_ragged_batch, tiny_mistral3
from tests.helpers.tiny_qwen3_5 import FULL_ATTENTION_LAYERS, tiny_qwen3_5
from tests.helpers.tiny_qwen3_vl import qwen3_vl_batch

NEW_TOKENS = 10


def _separator_and_rows(batch: Batch, row: int) -> tuple[torch.Tensor, int, list[int]]:
    """Row ``row``'s visual positions (one image), its separator and the posterior's rows: the
    separator and every real token after it (the paper's j >= i_e, the default)."""
    visual = batch.visual_mask()[row].nonzero().flatten()
    separator = int(visual[-1]) + 1
    rows = [r for r in range(separator, batch.seq_len) if batch.attention_mask[row, r]]
    return visual, separator, rows


def _attention_weights(model, layer: int, batch: Batch) -> torch.Tensor:
    """Eager attention weights [B, H, S, S] of decoder layer ``layer`` (its attention module's output)."""
    adapter = priortr.adapters.adapter_for(model)
    attention = adapter.attention(adapter.decoder_layers(model)[layer])
    kept: list[torch.Tensor] = []
    handle = attention.register_forward_hook(lambda module, args, out: kept.append(out[1]))
    try:
        with torch.no_grad():
            model(**batch.kwargs())
    finally:
        handle.remove()
    return kept[0]


CASES = [
    ("gemma3", 1),
    ("gemma3", 2),
    ("qwen3.5", 1),
    ("mistral3", 1),
    ("glm4v", 1),
    ("llama4", 0),
    ("llama4", 1),
    ("llava-onevision-1.5", 1),
    ("glm46v", 1),
    ("glm46v-moe", 1),
]


@pytest.mark.parametrize(("family", "layer"), CASES)
def test_prior_and_posterior_are_the_scored_layers_own_attention(family, layer):
    """Q, P and FastV's last row at the scored layer equal those read off its eager attention weights
    (float32: eager float64 turns padded rows into NaN), with the layer's own window: at Gemma 3's sliding
    layer the separator sees only the image tokens within the window (zero prior elsewhere), and a last
    row farther from the image than the window sees none of it: it has no evidence (NaN, which
    ``strict=True`` refuses)."""
    build, make_batch = FAMILIES[family]
    eager = build(attn="eager", dtype=torch.float32)
    batch = make_batch(eager, 2)
    weights = _attention_weights(eager, layer, batch).mean(dim=1)  # [B, S, S], head mean
    model = build(dtype=torch.float32)
    with priortr.apply(model, method="fastv", budget=batch.n_visual, layer=layer) as handle, torch.no_grad():
        model(**batch.kwargs())
    result = handle.last
    window = compat.layers.windows(model.config.get_text_config())[layer]
    for row in range(batch.batch_size):
        visual, separator, rows = _separator_and_rows(batch, row)
        prior = weights[row, separator, visual]
        posterior = weights[row][rows][:, visual].mean(dim=0)
        last = weights[row, batch.seq_len - 1, visual]
        torch.testing.assert_close(result.prior[row], prior / prior.sum(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result.posterior[row], posterior / posterior.sum(), atol=1e-6, rtol=1e-5)
        if last.sum() > 0:
            torch.testing.assert_close(result.scores[row], last / last.sum(), atol=1e-6, rtol=1e-5)
        else:
            assert window is not None and result.scores[row].isnan().all()
    if family == "gemma3" and GEMMA3_LAYER_TYPES[layer] == "sliding_attention":
        visual, separator, _ = _separator_and_rows(batch, 0)
        outside = visual <= separator - window.size
        assert outside.any() and (result.prior[0][outside] == 0).all()


def test_scores_without_evidence_warn_once_and_strict_names_the_fix():
    """FastV at Gemma 3's sliding layer 1: row 1's last token is farther from the image than the window, so
    its scores are NaN and the image's first tokens are kept. Before: silently (strict=True said only
    "cannot L1-normalise 1 row(s)"); now one warning per attach, after generate() or when ``last`` is
    read, and strict=True names the fix. Scored at the global layer 2 the same prompts warn nothing."""
    model = tiny_gemma3(dtype=torch.float32)
    batch = gemma3_batch(model, 2)
    budget = batch.n_visual - 4
    fix = "score a layer that attends to the image"
    with priortr.apply(model, method="fastv", budget=budget, layer=1) as handle, torch.no_grad():
        with pytest.warns(priortr.DegenerateScoresWarning, match=f"fastv ranked an image .* {fix}"):
            generate(model, batch, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            generate(model, batch, 2)  # once per attach
        assert handle.last.scores[1].isnan().all() and not handle.last.scores[0].isnan().any()
    with priortr.apply(model, method="fastv", budget=budget, layer=1) as handle, torch.no_grad():
        model(**batch.kwargs())  # a forward call: read with handle.last
        with pytest.warns(priortr.DegenerateScoresWarning, match=fix):
            assert handle.last is not None
    global_layer = priortr.apply(model, method="fastv", budget=budget, layer=2)
    with global_layer, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(model, batch, 2)
    strict = priortr.apply(model, method="fastv", budget=budget, layer=1, strict=True)
    with strict, torch.no_grad(), pytest.raises(ValueError, match=f"cannot L1-normalise 1 row.*{fix}"):
        model(**batch.kwargs())


@pytest.mark.parametrize("layer", [0, 2])
def test_a_linear_attention_layer_is_refused_naming_the_nearest_attention_layer(layer):
    model = tiny_qwen3_5()
    assert priortr.adapters.adapter_for(model).attention_layers(model) == FULL_ATTENTION_LAYERS
    with pytest.raises(
        ValueError, match=r"decoder layer \d of this model has no softmax attention.*score layer 1 instead"
    ):
        priortr.apply(model, budget=4, layer=layer)
    with pytest.raises(ValueError, match="score layer 1"):
        priortr.apply(model, method="priortr", stages=[(1, 8), (2, 4)])
    with pytest.raises(ValueError, match="the layer after the scored one"):
        priortr.apply(model, method="pdrop", stages=[(1, 8)])  # ranks with layer 2, a linear one
    priortr.apply(model, budget=4, layer=1).remove()  # the full-attention layer is accepted
    priortr.apply(model, method="random", budget=4, layer=1).remove()


MODELS = {
    "qwen3.5": (tiny_qwen3_5, qwen3_vl_batch),
    "gemma3": (tiny_gemma3, gemma3_batch),
    "gemma3, window past the pruned prompt": (lambda: tiny_gemma3(window=24), gemma3_batch),
    "mistral3, every layer sliding": (lambda: tiny_mistral3(sliding_window=12), mistral3_batch),
    "llama4": (tiny_llama4, llama4_batch),
    "llama4, chunks past the pruned prompt": (lambda: tiny_llama4(chunk=24), llama4_batch),
    "gemma4": (tiny_gemma4, gemma4_batch),
    "gemma4 e2b, shared keys": (tiny_gemma4_e2b, gemma4_batch),
}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", MODELS)
def test_decoding_across_the_window_edge_matches_the_reference(name, cache):
    """Ten greedy steps, so that decoding slides past the window (and, with a window longer than the
    pruned prompt, from inside it to past it); prefill and every step equal the reference in float64."""
    build, make_batch = MODELS[name]
    model = build()
    if cache == "static":
        skip_unless_stock_runs_static(model)
        skip_gemma4_static_window_before_checked(model)
    batch = make_batch(model, 2)
    with priortr.apply(model, budget=5, layer=1) as handle, torch.no_grad():
        logits = model(**batch.kwargs()).logits
        result = handle.last
        out = generate(model, batch, NEW_TOKENS, cache_implementation=cache)
    assert torch.equal(handle.last.kept, result.kept)  # the generate() prefill ranks as the forward did
    pruned = pruned_columns(batch, result.kept)
    with reference_for(model, [(1, pruned)], batch.attention_mask), torch.no_grad():
        reference, real = kept_rows(model(**batch.kwargs()).logits, result, batch)
        expected = generate(model, batch, NEW_TOKENS, cache_implementation=cache)
    atol = logits_atol(model)
    torch.testing.assert_close(logits[real], reference[real], atol=atol, rtol=0)
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), atol=atol, rtol=0)
    with torch.no_grad():
        stock = generate(model, batch, NEW_TOKENS, cache_implementation=cache)
    assert (torch.stack(stock.logits) - torch.stack(out.logits)).abs().max() > 1e-6


RAGGED = {
    "gemma3, one image and two": (tiny_gemma3, gemma3_ragged_batch),
    "mistral3, every layer sliding": (lambda: tiny_mistral3(sliding_window=12), mistral3_ragged_batch),
    "gemma4 e2b, one image and two": (tiny_gemma4_e2b, gemma4_ragged_batch),
}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", RAGGED)
def test_ragged_rows_decode_across_the_window_as_each_row_alone(name, cache):
    """Rows with different visual-token counts pruned to different lengths (the shorter row gets fillers),
    a window shorter than the prompt (a static cache's window layers hold fewer slots than the pruned
    prompt): every row's ten greedy tokens and their logits equal that row's, run alone."""
    build, make_batch = RAGGED[name]
    model = build()
    batch = make_batch(model, 2)
    rows = [row_alone(batch, row) for row in range(batch.batch_size)]

    def decode(inputs):
        options = {"output_logits": True, "return_dict_in_generate": True, "cache_implementation": cache}
        steps = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}
        return model.generate(**inputs, **steps, **options)

    with torch.no_grad():
        stock = generate(model, batch, NEW_TOKENS, cache_implementation=cache)
        stock_alone = [decode(inputs) for inputs in rows]
    with priortr.apply(model, budget=0.4, layer=1) as handle, torch.no_grad():
        out = generate(model, batch, NEW_TOKENS, cache_implementation=cache)
        assert bool(handle.last.padding.any()), "the rows must be pruned to different lengths"
        alone = [decode(inputs) for inputs in rows]
    logits = torch.stack(out.logits)  # [T, B, V]
    for row in range(batch.batch_size):
        # The stock model's own batch-vs-row difference bounds how closely a row can match.
        noise = (torch.stack(stock_alone[row].logits)[:, 0] - torch.stack(stock.logits)[:, row]).abs().max()
        atol = max(logits_atol(model), 4 * float(noise))
        assert torch.equal(out.sequences[row, -NEW_TOKENS:], alone[row].sequences[0, -NEW_TOKENS:])
        torch.testing.assert_close(logits[:, row], torch.stack(alone[row].logits)[:, 0], atol=atol, rtol=0)
        assert (torch.stack(stock.logits)[:, row] - logits[:, row]).abs().max() > 1e-6


@pytest.mark.parametrize("name", ["qwen3.5", "gemma3"])
def test_the_report_says_which_caches_shrink_and_the_cache_holds_that(name):
    """``handle.last.cache``: full-attention caches go from the prompt to text + K entries, a window's
    from its tail of the prompt to its tail of the kept tokens, linear-attention states have no entries;
    the cache a generate() leaves holds exactly that (plus the one token fed back)."""
    build, make_batch = MODELS[name]
    model = build()
    batch = make_batch(model, 2)
    with priortr.apply(model, budget=5, layer=1) as handle, torch.no_grad():
        out = model.generate(
            **batch.kwargs(), max_new_tokens=1, do_sample=False, return_dict_in_generate=True
        )
    prompt, kept = batch.seq_len, batch.seq_len - batch.n_visual + 5
    text = model.config.get_text_config()
    report = handle.last.cache
    assert [entry.kind for entry in report] == [
        {"linear_attention": "state", "full_attention": "keys", "sliding_attention": "window"}[kind]
        for kind in text.layer_types
    ]
    for entry, layer in zip(report, out.past_key_values.layers, strict=True):
        if entry.kind == "state":
            assert (entry.unpruned, entry.pruned) == (0, 0) and getattr(layer, "keys", None) is None
            continue
        cap = prompt if entry.kind == "keys" else text.sliding_window - 1
        assert (entry.unpruned, entry.pruned) == (min(prompt, cap), min(kept, cap))
        assert layer.keys.shape[2] == entry.pruned
    assert any(entry.pruned < entry.unpruned for entry in report)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["qwen3.5", "gemma3", "mistral3", "glm4v", "llama4"])
def test_a_decode_step_reads_nothing_back(family, cache):
    """A decode step on a pruned cache syncs as often as a vanilla one and runs no per-layer hook; on
    full-attention and hybrid linear models it dispatches what vanilla does (at most two more ops). With
    local windows the step rebuilds its local layers' masks in the prompt's positions: a bounded number of
    extra ops (measured: 14 for Gemma 3's dynamic cache, 26 for its static one), still nothing read back.
    Llama 4's NoPE layers run one pre-hook each (host work: their cache's length counts the pruned
    tokens), and its chunked layers' masks are rebuilt as Gemma 3's sliding ones."""
    model = FAMILIES[family][0](dtype=torch.float32)
    if cache == "static":
        skip_unless_stock_runs_static(model)
    batch = FAMILIES[family][1](model, 1)
    vanilla = overhead.decode_step(overhead.count_generate(model, batch.kwargs(), cache_implementation=cache))
    with priortr.apply(model, budget=4, layer=1):
        calls = overhead.count_generate(model, batch.kwargs(), cache_implementation=cache)
    prefill, decode = calls[0], overhead.decode_step(calls)
    adapter = priortr.adapters.adapter_for(model)
    layers = adapter.decoder_layers(model)
    placed = sum(
        adapter.scales_queries(adapter.attention(layers[i])) for i in adapter.attention_layers(model)
    )
    assert decode.syncs == vanilla.syncs, decode.sync_names - vanilla.sync_names
    assert decode.hooks <= 1 + placed < prefill.hooks
    local = family in ("gemma3", "llama4")
    assert decode.ops - vanilla.ops <= (30 if local else 2) + placed, decode.names - vanilla.names


@pytest.mark.parametrize("family", ["qwen3.5", "gemma3", "llama4", "mistral3", "glm4v"])
def test_compiled_decode_makes_the_graphs_vanilla_makes(family):
    model = FAMILIES[family][0](dtype=torch.float32)
    skip_unless_stock_runs_static(model)  # compiled decoding runs on a static cache
    batch = FAMILIES[family][1](model, 1)
    vanilla = overhead.count_compiled_graphs(model, batch.kwargs())
    options = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
    with priortr.apply(model, budget=4, layer=1), torch.no_grad():
        eager = model.generate(**batch.kwargs(), cache_implementation="static", **options)
        assert overhead.count_compiled_graphs(model, batch.kwargs()) == vanilla
        compiled = overhead.compiled_generate(model, batch.kwargs(), **options)
    assert torch.equal(compiled, eager)


def test_a_hybrid_cache_continued_without_priortr_cannot_be_continued_with_it():
    """Without priortr attached, the pruned cache's first attention layer refuses the call, but Qwen3.5's
    linear-attention layer 0 has already stepped its state by then: continuing that cache with priortr
    attached again is refused too (it no longer stands for the conversation)."""
    model = tiny_qwen3_5()
    batch = qwen3_vl_batch(model, 1)
    with priortr.apply(model, budget=4, layer=1), torch.no_grad():
        out = model.generate(
            **batch.kwargs(), max_new_tokens=2, do_sample=False, return_dict_in_generate=True
        )
    ids = torch.cat([out.sequences, torch.tensor([[7]])], dim=1)
    turn = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": 1, "do_sample": False}
    with pytest.raises(ValueError, match="no priortr pruning is attached"), torch.no_grad():
        model.generate(**turn, past_key_values=out.past_key_values)
    with (
        priortr.apply(model, budget=4, layer=1),
        pytest.raises(ValueError, match="already continued once without priortr"),
        torch.no_grad(),
    ):
        model.generate(**turn, past_key_values=out.past_key_values)
