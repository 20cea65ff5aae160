"""Misuse of the Python API: a pruned cache wherever it goes, copies and pickles of an attached model,
removed handles, conflicting arguments, labels, threads. Each either gives exactly the outputs of the
masked reference (tests/helpers/oracle.py, float64) or is refused with a message that names the fix."""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, StaticCache

import priortr
from priortr.engine.ledger import ATTRIBUTE, write_ledger
from priortr.tools import viz
from tests.helpers.checkpoint import save_tiny_llava_checkpoint
from tests.helpers.families import setup
from tests.helpers.oracle import masked_reference
from tests.helpers.pruned import conversation, pruned_columns
from tests.helpers.tiny import LLAVA_IMAGE_ID, llava_batch, tiny_llava

LAYER, BUDGET, NEW_TOKENS = 1, 5, 4
GREEDY = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}
SCORES = {"output_logits": True, "return_dict_in_generate": True}


@pytest.fixture(scope="module")
def llava():
    return tiny_llava()


QUESTION_TOKENS = 3


def first_turn(model, batch, cache: str = "dynamic"):
    """Turn 1 under pruning: (its generate output, its kept tokens, the turn-2 conversation and mask). A
    static cache is sized for both turns, as a stock one must be: a pruned prefill leaves it the room the
    stock cache would have for new tokens (its pruned tokens' slots go)."""
    caching = {"cache_implementation": cache}
    if cache == "static":
        room = batch.seq_len + 2 * NEW_TOKENS + QUESTION_TOKENS
        caching = {"past_key_values": StaticCache(config=model.config.get_text_config(), max_cache_len=room)}
    with priortr.apply(model, budget=BUDGET, layer=LAYER) as handle, torch.no_grad():
        first = model.generate(**batch.kwargs(), **caching, return_dict_in_generate=True, **GREEDY)
    shape = (batch.batch_size, QUESTION_TOKENS)
    question = torch.randint(3, 150, shape, generator=torch.Generator().manual_seed(5))
    history = torch.cat([first.sequences, question], dim=1)
    mask = torch.cat([batch.attention_mask, torch.ones_like(history[:, batch.seq_len :])], dim=1)
    return first, handle.last.kept, history, mask


def second_turn(model, batch, history, mask, cache):
    """Turn 2 on ``cache``: the whole conversation without the image (it is in the cache)."""
    inputs = {
        key: value
        for key, value in conversation(batch, history, mask).kwargs().items()
        if key != "pixel_values"
    }
    with torch.no_grad():
        return model.generate(**inputs, past_key_values=cache, **GREEDY, **SCORES)


def reference_turn(model, batch, kept, history, mask):
    """Turn 2 of the masked reference: the whole conversation, the pruned columns hidden."""
    with masked_reference(model, LAYER, pruned_columns(batch, kept), batch.attention_mask), torch.no_grad():
        return model.generate(**conversation(batch, history, mask).kwargs(), **GREEDY, **SCORES)


def assert_same_turn(out, expected) -> None:
    assert torch.equal(out.sequences[:, -NEW_TOKENS:], expected.sequences[:, -NEW_TOKENS:])
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), atol=1e-10, rtol=0)


@pytest.mark.parametrize("family", ["llava", "qwen2.5-vl"])
def test_a_deep_copied_cache_continues_like_the_original(family):
    """The usual prefix-cache reuse: both the copy and the original continue as the masked reference,
    independently of each other."""
    model, batch = setup(family, 2)
    first, kept, history, mask = first_turn(model, batch)
    cache = first.past_key_values
    length = cache.get_seq_length()
    copied = copy.deepcopy(cache)
    reference = reference_turn(model, batch, kept, history, mask)
    with priortr.apply(model, budget=BUDGET, layer=LAYER):
        on_copy = second_turn(model, batch, history, mask, copied)
        assert cache.get_seq_length() == length, "continuing the copy must leave the original alone"
        on_original = second_turn(model, batch, history, mask, cache)
    assert_same_turn(on_copy, reference)
    assert_same_turn(on_original, reference)

    # Negative control: the same copy without its record (what the stock model would do) differs.
    bare = copy.deepcopy(first_turn(model, batch)[0].past_key_values)
    write_ledger(bare, None)
    stock = second_turn(model, batch, history, mask, bare)
    assert (torch.stack(stock.logits) - torch.stack(reference.logits)).abs().max() > 1e-6


def test_a_new_image_on_a_deep_copied_cache_is_refused(llava):
    batch = llava_batch(llava)
    with priortr.apply(llava, budget=4), torch.no_grad():
        copied = copy.deepcopy(llava(**batch.kwargs(), use_cache=True).past_key_values)
        ids = torch.full((1, 2), LLAVA_IMAGE_ID)
        with pytest.raises(ValueError, match="new images on a pruned cache"):
            llava(input_ids=ids, pixel_values=batch.pixel_values, past_key_values=copied)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_pruned_cache_after_remove_is_refused_then_continues_under_a_new_apply(cache):
    """The stock model would read the pruned cache with the wrong positions: it is refused before
    anything is written to the cache, and a new apply (another method and budget: the cache carries
    what it needs) continues it exactly."""
    model, batch = setup("llava", 2)
    first, kept, history, mask = first_turn(model, batch, cache)
    pruned = first.past_key_values
    length = int(pruned.get_seq_length())
    with pytest.raises(ValueError, match="no priortr pruning is attached"):
        second_turn(model, batch, history, mask, pruned)
    assert int(pruned.get_seq_length()) == length, "a refused call must leave the cache as it was"
    with priortr.apply(model, method="fastv", budget=2, layer=2):
        again = second_turn(model, batch, history, mask, pruned)
    assert_same_turn(again, reference_turn(model, batch, kept, history, mask))


def test_a_pickled_cache_is_refused_on_the_stock_model_and_continues_under_apply():
    model, batch = setup("llava", 2)
    first, kept, history, mask = first_turn(model, batch)
    loaded = pickle.loads(pickle.dumps(first.past_key_values))
    assert getattr(loaded, ATTRIBUTE).kept_length == getattr(first.past_key_values, ATTRIBUTE).kept_length
    with pytest.raises(ValueError, match="no priortr pruning is attached"):
        second_turn(model, batch, history, mask, copy.deepcopy(loaded))
    with priortr.apply(model, budget=BUDGET, layer=LAYER):
        continued = second_turn(model, batch, history, mask, loaded)
    assert_same_turn(continued, reference_turn(model, batch, kept, history, mask))


def test_a_reset_cache_is_a_plain_cache_again():
    """generate() resets a static cache it reuses: the stock model then runs on it as on a new one, and
    pruning attached later treats it as the unpruned cache it now is (the old record no longer counts)."""
    model, batch = setup("llava", 2)
    with torch.no_grad():
        stock = model.generate(**batch.kwargs(), cache_implementation="static", **GREEDY, **SCORES)
    cache = first_turn(model, batch, "static")[0].past_key_values
    cache.reset()
    with torch.no_grad():
        assert_same_turn(model.generate(**batch.kwargs(), past_key_values=cache, **GREEDY, **SCORES), stock)
        cache.reset()
        model(**batch.kwargs(), past_key_values=cache, use_cache=True)  # a stock prefill into it
    step = {
        "input_ids": torch.full((batch.batch_size, 1), 7),
        "attention_mask": torch.cat([batch.attention_mask, torch.ones_like(batch.attention_mask[:, :1])], 1),
    }
    with torch.no_grad():
        unpruned = model(**step, past_key_values=copy.deepcopy(cache)).logits
        with priortr.apply(model, budget=BUDGET, layer=LAYER):
            attached = model(**step, past_key_values=cache).logits
    torch.testing.assert_close(attached, unpruned, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "save",
    [copy.deepcopy, pickle.dumps, lambda model: torch.save(model, io.BytesIO())],
    ids=["deepcopy", "pickle", "torch.save"],
)
def test_copying_or_pickling_an_attached_model_is_refused(llava, save):
    """The copy would carry hooks bound to this model's engine; remove, copy, apply again instead."""
    batch = llava_batch(llava)
    with priortr.apply(llava, budget=4), pytest.raises(TypeError, match=r"call handle.remove\(\) first"):
        save(llava)
    fresh = tiny_llava()
    with torch.no_grad():
        assert torch.equal(copy.deepcopy(llava)(**batch.kwargs()).logits, fresh(**batch.kwargs()).logits)


def test_a_removed_handle_cannot_be_entered_again(llava):
    handle = priortr.apply(llava, budget=4)
    with handle:
        assert handle.attached
    assert not handle.attached
    with pytest.raises(ValueError, match="this handle was removed"), handle:
        pass
    handle.remove()  # removing twice is harmless


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"stages": [(1, 4)], "budget": 8}, "conflicts with budget=8"),
        ({"stages": [(1, 4)], "layer": 1}, "conflicts with layer=1"),
        ({"stages": [(1, 4)], "budget": 64}, "conflicts with budget=64"),  # the default, but explicit
        ({"stages": {1: 4}}, "list of \\(layer, budget\\) pairs; got \\{1: 4\\}"),
        ({"stages": [1, 4]}, "list of \\(layer, budget\\) pairs"),
        ({"strict": "no"}, "strict must be True or False"),
        ({"seed": 1.5}, "seed must be an int"),
        ({"options": [("pivots", 2)]}, "options must be a dict"),
    ],
)
def test_conflicting_or_mistyped_arguments_are_refused(llava, arguments, message):
    with pytest.raises(ValueError, match=message):
        priortr.apply(llava, **arguments)


def test_stages_alone_replace_budget_and_layer(llava):
    batch = llava_batch(llava)
    with priortr.apply(llava, stages=[(0, 8), (1, 4)]) as handle, torch.no_grad():
        llava(**batch.kwargs())
    assert [stage.layer for stage in handle.last.stages] == [0, 1]
    assert handle.last.kept.shape == (1, 4)


WRAPPERS = {"torch.compile": torch.compile, "DataParallel": torch.nn.DataParallel}


@pytest.mark.parametrize("removal", ["handle", "detach through the other"])
@pytest.mark.parametrize("first", ["wrapper", "model"])
@pytest.mark.parametrize("wrap", WRAPPERS)
def test_a_wrapper_and_the_model_it_wraps_are_one_model(llava, wrap, first, removal):
    """Pruning attached through a wrapper (or the model) is refused a second time through the model (or
    the wrapper) with the usual message; the model prunes; removing it by its handle, or by
    ``priortr.detach`` through the other, restores the stock model: no hook left, the same tokens."""
    wrapper = WRAPPERS[wrap](llava)
    batch = llava_batch(llava, batch_size=2)

    def greedy():
        with torch.no_grad():
            return llava.generate(**batch.kwargs(), **GREEDY, **SCORES)

    stock = greedy()
    one, other = (wrapper, llava) if first == "wrapper" else (llava, wrapper)
    handle = priortr.apply(one, budget=BUDGET, layer=LAYER)
    with pytest.raises(ValueError, match="this model already has priortr attached"):
        priortr.apply(other, budget=BUDGET, layer=LAYER)
    pruned = greedy()
    assert handle.last.pruned
    assert not torch.equal(torch.stack(pruned.logits), torch.stack(stock.logits))
    if wrap == "torch.compile":  # the wrapper's generate is the model's, pruned
        with torch.no_grad():
            through = wrapper.generate(**batch.kwargs(), **GREEDY, **SCORES)
        assert torch.equal(through.sequences, pruned.sequences)
    if removal == "handle":
        handle.remove()
    else:
        assert priortr.detach(other) is True
    assert not handle.attached and priortr.detach(one) is False
    assert "generate" not in vars(llava) and not llava.model._forward_pre_hooks
    after = greedy()
    assert torch.equal(after.sequences, stock.sequences)
    assert torch.equal(torch.stack(after.logits), torch.stack(stock.logits))


def test_the_inner_model_is_refused_with_the_class_to_pass(llava):
    with pytest.raises(ValueError, match=r"pass the \*ForConditionalGeneration model.*LlavaModel"):
        priortr.apply(llava.model)


def test_labels_on_a_pruned_forward_name_the_fix(llava):
    batch = llava_batch(llava)
    labels = batch.input_ids.masked_fill(batch.visual_mask(), -100)
    with torch.no_grad():
        stock = llava(**batch.kwargs(), labels=labels).loss
    refused = pytest.raises(ValueError, match="labels= cannot be used with pruning attached")
    with priortr.apply(llava, budget=4), torch.no_grad(), refused:
        llava(**batch.kwargs(), labels=labels)
    with priortr.apply(llava, budget=batch.n_visual), torch.no_grad():  # nothing pruned: the stock loss
        assert torch.equal(llava(**batch.kwargs(), labels=labels).loss, stock)
    with torch.no_grad():
        assert torch.equal(llava(**batch.kwargs(), labels=labels).loss, stock)
    assert "_loss_function" not in vars(llava)


def test_two_threads_on_one_model_each_get_their_own_pruning():
    """Thread A's prefill is held inside decoder layer 2 while thread B runs a whole pruned generate
    on other inputs; both must get what they get alone (the engine's per-call state is per thread)."""
    model = tiny_llava()
    batch_a, batch_b = llava_batch(model, batch_size=1, seed=1), llava_batch(model, batch_size=2, seed=2)
    with priortr.apply(model, budget=BUDGET, layer=LAYER) as handle, torch.no_grad():
        alone_a = model(**batch_a.kwargs()).logits
        alone_b = model.generate(**batch_b.kwargs(), **GREEDY, **SCORES)
        held, release, results = threading.Event(), threading.Event(), {}
        thread_a = None

        def hold(module, args):
            if threading.current_thread() is thread_a:
                held.set()
                release.wait(timeout=60)

        blocker = model.model.language_model.layers[2].register_forward_pre_hook(hold)

        def run_a():
            try:
                with torch.no_grad():
                    results["a"] = model(**batch_a.kwargs()).logits
            except Exception as error:  # reported below, in the main thread
                results["a"] = error

        thread_a = threading.Thread(target=run_a)
        try:
            thread_a.start()
            assert held.wait(timeout=60)
            results["b"] = model.generate(**batch_b.kwargs(), **GREEDY, **SCORES)
        finally:
            release.set()
            thread_a.join(timeout=60)
            blocker.remove()
    assert not isinstance(results["a"], Exception), results["a"]
    torch.testing.assert_close(results["a"], alone_a, atol=1e-10, rtol=0)
    assert torch.equal(results["b"].sequences, alone_b.sequences)
    torch.testing.assert_close(
        torch.stack(results["b"].logits), torch.stack(alone_b.logits), atol=1e-10, rtol=0
    )
    assert handle.last.kept.shape == (2, BUDGET)  # the prefill that started last: thread B's


@pytest.mark.parametrize("options", [{"num_beams": 2}, {"num_beams": 2, "num_return_sequences": 2}])
def test_beam_search_matches_the_masked_reference(llava, options):
    batch = llava_batch(llava, batch_size=2)
    with priortr.apply(llava, budget=BUDGET, layer=LAYER) as handle, torch.no_grad():
        out = llava.generate(**batch.kwargs(), **GREEDY, **options)
    beams = options["num_beams"]  # generate() expands every row to its beams before the prefill
    kept = handle.last.kept[::beams]
    assert torch.equal(handle.last.kept, kept.repeat_interleave(beams, dim=0))
    pruned = pruned_columns(batch, kept).repeat_interleave(beams, dim=0)
    mask = batch.attention_mask.repeat_interleave(beams, dim=0)
    with masked_reference(llava, LAYER, pruned, mask), torch.no_grad():
        reference = llava.generate(**batch.kwargs(), **GREEDY, **options)
    assert torch.equal(out, reference)


@pytest.fixture(scope="module")
def saved_llava(tmp_path_factory: pytest.TempPathFactory):
    """(model, processor) of the saved tiny LLaVA checkpoint."""
    path = save_tiny_llava_checkpoint(tmp_path_factory.mktemp("robustness") / "tiny-llava")
    return AutoModelForImageTextToText.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "the prompt is empty"),
        ("  \n", "the prompt is empty"),
        ("<image> What colour is it?", "the prompt contains '<image>'"),
    ],
)
def test_prompts_without_a_question_or_with_a_typed_placeholder_are_refused(saved_llava, prompt, message):
    """Before: an empty prompt was pruned on the chat template's tokens alone, without a word; a typed
    placeholder got the processor's count of image tokens."""
    model, processor = saved_llava
    image = Image.new("RGB", (40, 40), (200, 10, 10))
    with pytest.raises(ValueError, match=message):
        viz.attention_maps(model, processor, image, prompt, layers=(1,), budgets=(4,))
    assert viz.attention_maps(model, processor, image, "What colour is it?", layers=(1,), budgets=(4,))
