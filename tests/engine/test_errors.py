"""Every bad input gets a clear error naming the fix; nothing changes results silently."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

import priortr
from tests.helpers.tiny import LLAVA_IMAGE_ID, llava_batch, tiny_llava


@pytest.fixture(scope="module")
def llava():
    return tiny_llava()


@pytest.mark.parametrize(
    "budget, message",
    [
        (0, "budget"),
        (-3, "budget"),
        (2.5, "int"),
        (1.5, "ratio in \\(0, 1\\)"),
        (0.0, "budget"),
        (True, "bool"),
    ],
)
def test_bad_budget(llava, budget, message):
    with pytest.raises(ValueError, match=message):
        priortr.apply(llava, budget=budget)


@pytest.mark.parametrize("layer", [-1, 3, 99, 1.0, True])
def test_layer_outside_range(llava, layer):
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\]"):
        priortr.apply(llava, layer=layer)


def test_unknown_method_lists_the_available_ones(llava):
    with pytest.raises(ValueError, match=r"unknown method 'fastvv'.*priortr"):
        priortr.apply(llava, method="fastvv")


@pytest.mark.parametrize("option", [{"heads": "median"}, {"posterior_rows": "all"}, {"separator_offset": -1}])
def test_bad_options(llava, option):
    with pytest.raises(ValueError, match=next(iter(option))):
        priortr.apply(llava, **option)


def test_unsupported_model_names_the_supported_ones():
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    with pytest.raises(ValueError, match=r"does not support LlamaForCausalLM.*llava.*qwen2_5_vl"):
        priortr.apply(LlamaForCausalLM(config))


def test_apply_twice_is_refused(llava):
    with priortr.apply(llava), pytest.raises(ValueError, match="already has priortr attached"):
        priortr.apply(llava)
    priortr.apply(llava).remove()  # removed handles free the model again


def test_a_dropped_handle_is_detached_through_the_model(llava):
    """Before: a handle dropped without remove() left the model pruned, with no public way back."""
    batch = llava_batch(llava)
    with torch.no_grad():
        stock = llava(**batch.kwargs()).logits
        priortr.apply(llava, budget=4)  # the handle is not kept
        gc.collect()
        assert llava(**batch.kwargs()).logits.shape[1] < stock.shape[1]  # still pruned
        with pytest.raises(ValueError, match=r"priortr.detach\(model\)"):
            priortr.apply(llava)
        assert priortr.detach(llava) is True
        assert torch.equal(llava(**batch.kwargs()).logits, stock)
        assert priortr.detach(llava) is False  # nothing attached: nothing to do
        with priortr.apply(llava, budget=4) as handle:
            assert priortr.detach(llava) is True and not handle.attached
        handle.remove()  # idempotent after a detach


def test_prompt_without_image_is_skipped_with_a_notice(llava):
    batch = llava_batch(llava)
    ids = batch.input_ids[:, batch.image_end[0] :]
    with torch.no_grad():
        stock = llava(input_ids=ids).logits
    with priortr.apply(llava, budget=4) as handle, torch.no_grad():
        with pytest.warns(priortr.PruningSkippedWarning, match="no image tokens"):
            logits = llava(input_ids=ids).logits
        assert handle.last is None
    assert torch.equal(logits, stock)
    with priortr.apply(llava, budget=4, strict=True), pytest.raises(ValueError, match="strict=True"):
        llava(input_ids=ids)


def test_image_at_the_very_end_has_no_separator(llava):
    batch = llava_batch(llava)
    ids = batch.input_ids[:, : batch.image_end[0]]
    with priortr.apply(llava, budget=4), pytest.raises(ValueError, match=r"separator slot.*does not exist"):
        llava(input_ids=ids, pixel_values=batch.pixel_values)


@pytest.mark.parametrize("rows", ["from_separator", "after_separator", "from_separator_except_last"])
def test_no_instruction_after_the_separator(llava, rows):
    """Without a token after the separator every posterior but the last row's is the prior Q itself
    (every score 0): refused, naming the fix; ``last`` reads the separator's row and runs."""
    batch = llava_batch(llava)
    ids = batch.input_ids[:, : batch.image_end[0] + 1]
    with (
        priortr.apply(llava, budget=4, posterior_rows=rows),
        pytest.raises(ValueError, match="no instruction token follows"),
    ):
        llava(input_ids=ids, pixel_values=batch.pixel_values)
    with priortr.apply(llava, budget=4, posterior_rows="last") as handle:
        llava(input_ids=ids, pixel_values=batch.pixel_values)
    assert handle.last.kept.shape == (1, 4)


def test_authors_qwen_rows_need_two_tokens_after_the_separator(llava):
    """Rows i_e .. T-2 with one token after the separator are the separator's alone (P = Q): refused; the
    paper's default rows i_e .. T-1 run on the same prompt."""
    batch = llava_batch(llava)
    ids = batch.input_ids[:, : batch.image_end[0] + 2]
    with (
        priortr.apply(llava, budget=4, posterior_rows="from_separator_except_last"),
        pytest.raises(ValueError, match="one token follows the separator"),
    ):
        llava(input_ids=ids, pixel_values=batch.pixel_values)
    with priortr.apply(llava, budget=4) as handle:
        llava(input_ids=ids, pixel_values=batch.pixel_values)
    assert handle.last.kept.shape == (1, 4)


def test_a_window_cache_on_global_layers_is_refused(llava):
    """A sliding-window cache is pruned with the layers that slide (Gemma 3's, tests/families); handed to
    layers that attend to every token, it would drop keys they still reach."""
    batch = llava_batch(llava)
    cache = DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=8) for _ in range(4)]
    with (
        priortr.apply(llava, budget=4),
        pytest.raises(ValueError, match="DynamicSlidingWindowLayer, which keeps only a window"),
    ):
        llava(**batch.kwargs(), past_key_values=cache, use_cache=True)


def test_new_image_on_a_pruned_cache_is_refused(llava):
    batch = llava_batch(llava)
    with priortr.apply(llava, budget=4), torch.no_grad():
        out = llava(**batch.kwargs(), use_cache=True)
        ids = torch.full((1, 2), LLAVA_IMAGE_ID)
        with pytest.raises(ValueError, match="new images on a pruned cache"):
            llava(input_ids=ids, pixel_values=batch.pixel_values, past_key_values=out.past_key_values)


def test_inputs_that_do_not_continue_the_cache_are_refused(llava):
    """Positions are device values: a decode step checks them only under strict=True (reading them would
    block the host on a GPU); a new turn's positions and every 2D mask's length are always checked."""
    batch = llava_batch(llava)
    with priortr.apply(llava, budget=4, strict=True), torch.no_grad():
        out = llava(**batch.kwargs(), use_cache=True)
        with pytest.raises(ValueError, match="do not continue the pruned cache"):
            llava(
                input_ids=torch.tensor([[5]]),
                position_ids=torch.tensor([[3]]),
                past_key_values=out.past_key_values,
            )
    with priortr.apply(llava, budget=4), torch.no_grad():
        out = llava(**batch.kwargs(), use_cache=True)
        with pytest.raises(ValueError, match="do not continue the pruned cache"):
            llava(
                input_ids=torch.tensor([[5, 6]]),
                position_ids=torch.tensor([[3, 4]]),
                past_key_values=out.past_key_values,
            )
        mask = torch.ones(1, 5, dtype=torch.long)
        with pytest.raises(ValueError, match="pass the mask of the whole conversation"):
            llava(input_ids=torch.tensor([[5]]), attention_mask=mask, past_key_values=out.past_key_values)
