"""A static cache after a pruned prefill holds the kept prompt and the generated tokens' slots only
(issue 47): every decode step attends over text + K + generated slots, not the unpruned prompt's
``max_cache_len``, and answers as the dynamic cache does."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import StaticCache

import priortr
from priortr import compat
from tests.helpers.tiny import llava_batch, tiny_llava

NEW_TOKENS = 4
OPTIONS = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}


@pytest.fixture(scope="module")
def llava():
    return tiny_llava(dtype=torch.float64)


def _generate(model, batch, **kwargs):
    with torch.no_grad():
        return model.generate(
            **batch.kwargs(), return_dict_in_generate=True, output_scores=True, **OPTIONS, **kwargs
        )


@pytest.mark.parametrize("method", ["priortr", "pdrop"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_static_cache_keeps_only_the_kept_slots(llava, method, batch_size):
    batch = llava_batch(llava, batch_size=batch_size)
    prompt = batch.kwargs()["input_ids"].shape[1]
    slots = (
        compat.cache.of_output(_generate(llava, batch, cache_implementation="static")).layers[0].keys.shape[2]
    )
    layer = 1 if method == "priortr" else None
    with priortr.apply(llava, method=method, budget=4, layer=layer) as handle:
        dynamic = _generate(llava, batch)
        static = _generate(llava, batch, cache_implementation="static")
        kept = handle.last.positions.shape[1]
    assert kept < prompt  # negative control: the prompt was pruned
    cache = compat.cache.of_output(static)
    for cache_layer in compat.cache.key_value_layers(cache):
        for store in (cache_layer.keys, cache_layer.values):
            assert store.shape[2] == slots - (prompt - kept)  # main: every slot, each decode step reads them
    assert torch.equal(static.sequences, dynamic.sequences)
    for step_static, step_dynamic in zip(static.scores, dynamic.scores, strict=True):
        torch.testing.assert_close(step_static, step_dynamic, rtol=1e-10, atol=1e-10)


def test_a_reset_static_cache_takes_a_full_prompt_again(llava):
    """The shortened cache, reset, holds an unpruned prompt of the original length (text only: nothing to
    prune) and answers as a fresh cache does."""
    batch = llava_batch(llava, batch_size=1)
    ids = batch.kwargs()["input_ids"]
    text = {"input_ids": torch.randint(3, 190, ids.shape), "attention_mask": torch.ones_like(ids)}
    cache = StaticCache(config=llava.config.get_text_config(), max_cache_len=ids.shape[1] + NEW_TOKENS)
    name = next(n for n in compat.calls.CACHE_NAMES if n in inspect.signature(llava.forward).parameters)
    with priortr.apply(llava, budget=4, layer=1), torch.no_grad():
        llava.generate(**batch.kwargs(), **{name: cache}, **OPTIONS)
        assert cache.layers[0].keys.shape[2] < ids.shape[1]
        cache.reset()
        with pytest.warns(priortr.PruningSkippedWarning):
            reused = llava.generate(**text, **{name: cache}, **OPTIONS)
    with torch.no_grad():
        fresh = llava.generate(**text, cache_implementation="static", **OPTIONS)
    assert cache.layers[0].keys.shape[2] == ids.shape[1] + NEW_TOKENS
    assert torch.equal(reused, fresh)
