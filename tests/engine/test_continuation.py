"""Calls that carry more than their prompt: generate() without a cache, assisted decoding, and an
answer scored in one call inside ``handle.prompt_ends``. The kept set is the prompt's own and the
continuation runs on the kept tokens in every layer (``priortr.engine.continuation``), so each gives
what cached, pruned greedy decoding gives; float64 tiny models.

Before: each of these calls was pruned as a prompt whose instruction included the appended tokens, so
the kept set changed with them, and with it the answer.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers.utils import logging as transformers_logging

import priortr
from tests.helpers.families import FAMILIES
from tests.helpers.pruned import logits_atol
from tests.helpers.tiny import llava_batch, tiny_llava

LAYER, BUDGET = 1, 4
GREEDY = {
    "max_new_tokens": 5,
    "min_new_tokens": 5,
    "do_sample": False,
    "output_logits": True,
    "return_dict_in_generate": True,
}


@pytest.fixture(scope="module")
def llava():
    return tiny_llava()


def pruning(model, method: str = "priortr"):
    layer = {"layer": LAYER} if priortr.get_method(method).where == "layer" else {}
    return priortr.apply(model, method=method, budget=BUDGET, **layer)


@pytest.mark.parametrize(
    ("family", "method"),
    [
        ("llava", "priortr"),
        ("llava", "fastv"),
        ("llava", "pdrop"),
        ("llava", "divprune"),
        ("qwen2.5-vl", "priortr"),
        ("smolvlm", "priortr"),
        ("llama4", "priortr"),
    ],
)
def test_generate_without_a_cache_gives_cached_pruned_decoding(models, family, method):
    model = models[family]
    batch = FAMILIES[family][1](model, batch_size=2)  # row 0 left padded
    with torch.no_grad():
        stock = model.generate(**batch.kwargs(), **GREEDY, use_cache=False)
        with pruning(model, method) as handle:
            cached = model.generate(**batch.kwargs(), **GREEDY)
            kept = handle.last.kept
            uncached = model.generate(**batch.kwargs(), **GREEDY, use_cache=False)
            assert torch.equal(handle.last.kept, kept)  # every step: the prompt's kept set
    assert torch.equal(uncached.sequences, cached.sequences)
    atol = logits_atol(model)
    torch.testing.assert_close(torch.stack(uncached.logits), torch.stack(cached.logits), atol=atol, rtol=0)
    assert (torch.stack(stock.logits) - torch.stack(cached.logits)).abs().max() > 1e-6  # it was pruned


@pytest.mark.parametrize("row", [0, 1], ids=["left padded", "unpadded"])
@pytest.mark.parametrize("seed", [0, 3], ids=["draft = target", "another draft"])
def test_assisted_decoding_gives_cached_pruned_decoding(llava, row, seed):
    """The target verifies the draft's candidates in the call that reads the prompt, then on the pruned
    cache, whose rejected candidates generate() crops. Before, a left-padded row was also refused with a
    message about the attention mask."""
    batch = llava_batch(llava, batch_size=2)
    single = {key: value[row : row + 1] for key, value in batch.kwargs().items()}
    draft = tiny_llava(seed=seed)
    with torch.no_grad(), pruning(llava):
        cached = llava.generate(**single, **GREEDY)
        assisted = llava.generate(**single, **GREEDY, assistant_model=draft)
    assert torch.equal(assisted.sequences, cached.sequences)
    torch.testing.assert_close(torch.stack(assisted.logits), torch.stack(cached.logits), atol=1e-10, rtol=0)


def scoring_batch(batch, answers: list[list[int]]) -> dict:
    """``batch``'s prompts (left padded) followed by ``answers`` (right padded with 0, masked), every
    per-token input extended."""
    width = max(map(len, answers))
    ids = torch.zeros(batch.batch_size, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, answer in enumerate(answers):
        ids[row, : len(answer)], mask[row, : len(answer)] = torch.tensor(answer), 1
    inputs = batch.kwargs()
    inputs["input_ids"] = torch.cat([batch.input_ids, ids], dim=1)
    inputs["attention_mask"] = torch.cat([batch.attention_mask, mask], dim=1)
    if "mm_token_type_ids" in inputs:  # Qwen's token types: the answers are text (0)
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(ids)], dim=1)
    return inputs


@pytest.mark.parametrize("family", ["llava", "qwen2.5-vl", "llama4"])
def test_an_answer_scored_in_one_call_reads_as_cached_decoding_reads_it(models, family):
    model = models[family]
    batch = FAMILIES[family][1](model, batch_size=2)  # row 0 left padded
    answers = [[7, 8, 9], [10, 11]]
    inputs, width = scoring_batch(batch, answers), 3
    with torch.no_grad(), pruning(model) as handle:
        with handle.prompt_ends(at=batch.seq_len):
            logits = model(**inputs, use_cache=False).logits  # [B, S' + 3, V]
            kept = handle.last.kept
        whole = model(**inputs, use_cache=False).logits  # negative control: all of it read as prompt
        prefill = model(**batch.kwargs())  # cached decoding: the prompt, then the answer token by token
        assert torch.equal(handle.last.kept, kept)
        rows, cache = [prefill.logits[:, -1]], prefill.past_key_values
        for j in range(width - 1):
            step = model(
                input_ids=inputs["input_ids"][:, batch.seq_len + j : batch.seq_len + j + 1],
                attention_mask=inputs["attention_mask"][:, : batch.seq_len + j + 1],
                past_key_values=cache,
            )
            rows.append(step.logits[:, -1])
    expected = torch.stack(rows, dim=1)  # [B, 3, V]: row j predicts answer token j
    prompt_rows = logits.shape[1] - width
    assert prompt_rows == handle.last.positions.shape[1] == batch.seq_len - batch.n_visual + BUDGET
    got = logits[:, prompt_rows - 1 : prompt_rows - 1 + width]
    real = inputs["attention_mask"][:, batch.seq_len :].bool()
    torch.testing.assert_close(got[real], expected[real], atol=logits_atol(model), rtol=0)
    assert (whole[:, prompt_rows - 1 : prompt_rows - 1 + width][real] - expected[real]).abs().max() > 1e-6


def test_generate_restores_the_prompt_state_and_remove_restores_generate(llava):
    batch = llava_batch(llava, batch_size=1)
    with torch.no_grad(), pruning(llava) as handle:
        assert llava.generate.__name__ == "generate" and "generate" in vars(llava)
        llava.generate(**batch.kwargs(), **GREEDY, use_cache=False)
        assert handle._engine._prompt_ends == {}
    assert "generate" not in vars(llava)  # the class's generate() again


def test_what_a_call_with_a_continuation_cannot_do_is_refused(llava):
    batch = llava_batch(llava, batch_size=2)
    inputs = scoring_batch(batch, [[7, 8], [9]])
    with torch.no_grad(), pruning(llava) as handle:
        for at in (0, True, "5", 2.0):
            with pytest.raises(ValueError, match="at must be the prompt's column count"):
                handle.prompt_ends(at=at)
        hidden_states = pytest.raises(ValueError, match="output_hidden_states=True on a call that carries")
        with handle.prompt_ends(at=batch.seq_len), hidden_states:
            llava(**inputs, use_cache=False, output_hidden_states=True)
        images = pytest.raises(ValueError, match="image tokens after column")
        with handle.prompt_ends(at=int(batch.image_start[1])), images:  # the prompt ends before an image
            llava(**inputs, use_cache=False)


def test_priortrs_own_calls_log_no_transformers_deprecation(llava):
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` and logs a deprecation warning once per
    process when the old name is used; priortr's own calls (joining a prompt's output to its
    continuation's, reading a cache off an output) must not be what logs it. Before: generate(use_cache=
    False) and a call inside prompt_ends logged it, from compat/calls.py."""
    batch = llava_batch(llava, batch_size=2)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = transformers_logging.get_logger("transformers")
    logger.addHandler(handler)
    logging.Logger.warning_once.cache_clear()  # logged once per process: forget earlier tests' calls
    try:
        with pruning(llava) as handle, torch.no_grad():
            llava.generate(**batch.kwargs(), **{**GREEDY, "use_cache": False})
            with handle.prompt_ends(at=batch.seq_len - 2):
                out = llava(**batch.kwargs(), use_cache=False)
        assert not [message for message in messages if "deprecated" in message], messages
        old_name = getattr(type(out), "past_key_values", None)
        if isinstance(old_name, property):  # a release with the rename: the old name logs (the control)
            assert out.past_key_values is None
            assert any("deprecated" in message for message in messages), messages
    finally:
        logger.removeHandler(handler)
