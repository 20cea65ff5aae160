"""Physical pruning equals the masked reference (tests/helpers/oracle.py) on every kept position, in float64.

Each comparison is paired with a control showing it can fail: the unpruned model, renumbered RoPE
and an unpruned cache of layers 0..L all give different numbers.
"""

from __future__ import annotations

import pytest
import torch

import priortr
from priortr import compat
from priortr.engine.prefill import Prefill
from tests.helpers.families import FAMILIES, setup, skip_unless_stock_runs_static
from tests.helpers.pruned import conversation, kept_rows, logits_atol, pruned_columns, reference_for
from tests.helpers.tiny import Batch, llava_batch, tiny_llava

LAYER, BUDGET, NEW_TOKENS = 1, 5, 6


def generate(model, batch: Batch, **kwargs):
    return model.generate(
        **batch.kwargs(), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS, **kwargs
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch_size", [1, 2])
def test_prefill_logits_match_masked_reference(family, batch_size):
    model, batch = setup(family, batch_size)
    with priortr.apply(model, budget=BUDGET, layer=LAYER) as handle, torch.no_grad():
        logits = model(**batch.kwargs()).logits  # [B, S', V]
    result = handle.last
    assert result.kept.shape == (batch_size, BUDGET)
    assert logits.shape[1] == batch.seq_len - batch.n_visual + BUDGET
    with (
        reference_for(model, [(LAYER, pruned_columns(batch, result.kept))], batch.attention_mask),
        torch.no_grad(),
    ):
        reference = model(**batch.kwargs()).logits
    expected, real = kept_rows(reference, result, batch)
    torch.testing.assert_close(logits[real], expected[real], atol=logits_atol(model), rtol=0)

    with torch.no_grad():
        stock, _ = kept_rows(model(**batch.kwargs()).logits, result, batch)
    assert (stock[real] - logits[real]).abs().max() > 1e-6, "the unpruned model must differ"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_matches_masked_reference(family, batch_size, cache):
    model, batch = setup(family, batch_size)
    if cache == "static":
        skip_unless_stock_runs_static(model)
    options = {"cache_implementation": cache, "output_logits": True, "return_dict_in_generate": True}
    with priortr.apply(model, budget=BUDGET, layer=LAYER) as handle, torch.no_grad():
        out = generate(model, batch, **options)
    with reference_for(model, [(LAYER, pruned_columns(batch, handle.last.kept))], batch.attention_mask):
        ref = generate(model, batch, **options)
    assert torch.equal(out.sequences, ref.sequences)
    atol = logits_atol(model)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=atol, rtol=0)
    stock = generate(model, batch, **options)
    assert not torch.allclose(torch.stack(stock.logits), torch.stack(out.logits), atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_kv_cache_holds_text_plus_budget(family, cache):
    model, batch = setup(family, 2)
    if cache == "static":
        skip_unless_stock_runs_static(model)
    with priortr.apply(model, budget=BUDGET, layer=LAYER), torch.no_grad():
        out = model.generate(
            **batch.kwargs(),
            max_new_tokens=1,
            do_sample=False,
            return_dict_in_generate=True,
            cache_implementation=cache,
        )
    expected = batch.seq_len - batch.n_visual + BUDGET
    cache_obj = out.past_key_values
    assert int(cache_obj.get_seq_length()) == expected
    text = model.config.get_text_config()
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * len(cache_obj.layers)
    windows = compat.layers.windows(text)
    shared = priortr.adapters.adapter_for(model).kv_shared_layers(model)  # they read others' entries
    own = [index for index in range(len(kinds)) if index not in shared]
    kinds, windows = [kinds[index] for index in own], [windows[index] for index in own]
    layers = [layer for index, layer in enumerate(cache_obj.layers) if index not in shared]
    for kind, window, layer in zip(kinds, windows, layers, strict=True):
        if kind == "linear_attention":  # a recurrent state, nothing per token
            assert getattr(layer, "keys", None) is None
            continue
        # A sliding window's (or chunk's) cache holds its last tokens: window - 1 (dynamic), window slots
        # (static).
        held = expected if window is None else min(expected, window.size - (cache == "dynamic"))
        filled = layer.keys[:, :, :held].abs().sum(dim=(0, 1, 3)).ne(0)
        if window is None:
            assert filled.all()
        else:  # the kept tail: slots of kept tokens older than the prompt's stored tail stay empty
            assert filled[-1] and torch.equal(filled, filled.sort().values)
        if cache == "dynamic":
            assert layer.keys.shape[2] == held and layer.values.shape[2] == held
        else:
            assert layer.keys[:, :, held:].abs().sum() == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_full_budget_and_remove_are_bit_identical(family):
    model, batch = setup(family, 2)
    with torch.no_grad():
        stock_logits = model(**batch.kwargs()).logits
    stock_tokens = generate(model, batch)
    with priortr.apply(model, budget=batch.n_visual, layer=LAYER) as handle, torch.no_grad():
        assert torch.equal(model(**batch.kwargs()).logits, stock_logits)
        assert not handle.last.pruned
        assert torch.equal(generate(model, batch), stock_tokens)
    handle = priortr.apply(model, budget=2, layer=LAYER)
    with torch.no_grad():
        pruned_last = model(**batch.kwargs()).logits[:, -1]
    assert (pruned_last - stock_logits[:, -1]).abs().max() > 1e-6, "pruning must change the outputs"
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(**batch.kwargs()).logits, stock_logits)
    assert torch.equal(generate(model, batch), stock_tokens)


@pytest.mark.parametrize(
    "family",
    [
        "llava",
        "qwen2.5-vl",
        "mistral3",
        "glm4v",
        "qwen3.5",
        "gemma3",
        "llama4",
        "llava-onevision-1.5",
        "glm46v",
        "glm46v-moe",
    ],
)
@pytest.mark.parametrize("new_tokens_only", [False, True])
def test_second_turn_on_pruned_cache_matches_masked_reference(family, new_tokens_only):
    """Turn 1 prunes; turn 2 continues on the pruned cache (paper Appendix E)."""
    model, batch = setup(family, 2)
    gen = torch.Generator().manual_seed(7)
    with priortr.apply(model, budget=BUDGET, layer=LAYER) as handle, torch.no_grad():
        first = generate(model, batch, return_dict_in_generate=True)
        question = torch.randint(3, 150, (batch.batch_size, 4), generator=gen)
        history = torch.cat([first.sequences, question], dim=1)
        mask = torch.cat([batch.attention_mask, torch.ones_like(history[:, batch.seq_len :])], dim=1)
        turn = conversation(batch, history, mask)
        if new_tokens_only:
            # generate() takes only the unseen tokens when the mask spans the whole conversation.
            turn.input_ids = history[:, first.sequences.shape[1] - 1 :]
        inputs = {
            key: value for key, value in turn.kwargs().items() if key != "pixel_values"
        }  # cached already
        second = model.generate(
            **inputs,
            past_key_values=first.past_key_values,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    kept = handle.last.kept
    with reference_for(model, [(LAYER, pruned_columns(batch, kept))], batch.attention_mask):
        reference = model.generate(
            **conversation(batch, history, mask).kwargs(),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    assert torch.equal(second[:, -NEW_TOKENS:], reference[:, -NEW_TOKENS:])
    stock = model.generate(
        **conversation(batch, history, mask).kwargs(),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert stock.sequences.shape == reference.shape


@pytest.mark.parametrize("family", ["llava", "qwen2.5-vl"])
def test_negative_controls_are_caught(family, monkeypatch):
    model, batch = setup(family, 1)
    with priortr.apply(model, budget=BUDGET, layer=LAYER) as handle, torch.no_grad():
        good = generate(model, batch, output_logits=True, return_dict_in_generate=True)
    pruned = pruned_columns(batch, handle.last.kept)
    with reference_for(model, [(LAYER, pruned)], batch.attention_mask):
        ref = generate(model, batch, output_logits=True, return_dict_in_generate=True)
    torch.testing.assert_close(torch.stack(good.logits), torch.stack(ref.logits), atol=1e-10, rtol=0)

    original = Prefill._gather_layer_inputs

    def renumbered(self, call, index):
        """Negative control: layers after L get positions 0..S'-1 instead of the kept tokens' own."""
        full = call.rope
        original(self, call, index)
        if full[0].shape[1] == batch.seq_len:
            n = call.rope[0].shape[1]
            call.set_rope((full[0][:, :n], full[1][:, :n]))

    with monkeypatch.context() as patch:
        patch.setattr(Prefill, "_gather_layer_inputs", renumbered)
        with priortr.apply(model, budget=BUDGET, layer=LAYER), torch.no_grad():
            bad = generate(model, batch, output_logits=True, return_dict_in_generate=True)
    assert (torch.stack(bad.logits) - torch.stack(ref.logits)).abs().max() > 1e-6

    with monkeypatch.context() as patch:
        patch.setattr("priortr.compat.cache.compact", lambda cache, index, seq, layers: None)
        with priortr.apply(model, budget=BUDGET, layer=LAYER), torch.no_grad():
            try:
                bad = generate(model, batch, output_logits=True, return_dict_in_generate=True)
            except (RuntimeError, ValueError, IndexError):
                bad = None  # a shape error is also a caught defect
    if bad is not None:
        assert (torch.stack(bad.logits) - torch.stack(ref.logits)).abs().max() > 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_score_in_float32(dtype):
    model = tiny_llava(dtype=dtype)
    batch = llava_batch(model, batch_size=2)
    with priortr.apply(model, budget=BUDGET, layer=LAYER) as handle, torch.no_grad():
        out = model.generate(
            **batch.kwargs(), max_new_tokens=2, do_sample=False, return_dict_in_generate=True
        )
    result = handle.last
    assert result.scores.dtype == result.prior.dtype == torch.float32
    assert result.kept.shape == (2, BUDGET)
    assert bool((result.kept[:, 1:] > result.kept[:, :-1]).all())
    assert int(out.past_key_values.get_seq_length()) == batch.seq_len - batch.n_visual + BUDGET + 1
