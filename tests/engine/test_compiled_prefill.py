"""A pruned prefill under ``model.compile()`` (issue 47, item 1), counted with dynamo's own counters
(``torch._dynamo.utils.counters``) on the ``eager`` backend: it runs in as many graphs as the vanilla
prefill, its graph breaks are vanilla's plus the planning's, a second call of the same shape compiles
nothing, and it gives the eager pruned model's logits and kept tokens, whether the model was compiled
before or after ``priortr.apply`` (float64, CPU). The same counts hold on torch 2.11 (the floor, and the
accelerator image's torch) and 2.13+: CI runs this module on both.

Two torch 2.11 dynamo behaviours shaped the code these tests guard: it cannot trace ``id()`` of a tensor
made in the graph (the stage's RoPE/mask cache is keyed by each layer's declared kind, not by the ids of
what it received: 12 graphs and a recompile on 2.11 before), and it drops what a property setter of a
user object writes, silently (``compat.calls`` rewrites calls through methods; with setters, the layers
after the stage ran on the unpruned hidden states under compile, on 2.11 only).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.utils import counters

import priortr
from tests.helpers.tiny import llava_batch, tiny_llava


def _assert_within_vanillas_graphs(pruned: Compiled, vanilla: Compiled, stages: int) -> None:
    """No more graphs than vanilla, breaks no more than vanilla's plus one per stage, nothing recompiled
    on a second call of the shape."""
    assert pruned.graphs <= vanilla.graphs, "the stage runs inside the graphs"
    assert pruned.breaks <= vanilla.breaks + stages
    assert pruned.new_graphs == vanilla.new_graphs == 0, "a second call of one shape recompiles nothing"


@dataclass(frozen=True)
class Compiled:
    """Graphs and graph breaks of a call's first run, graphs made by a second run, and its outputs."""

    graphs: int
    breaks: int
    new_graphs: int
    logits: torch.Tensor
    kept: torch.Tensor | None


def _forward(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def _kept(handle: priortr.PruningHandle | None) -> torch.Tensor | None:
    return None if handle is None else handle.last.positions.clone()


def _compiled(model: torch.nn.Module, batch: dict, handle: priortr.PruningHandle | None) -> Compiled:
    """The compiled model's first and second call on ``batch``, counted."""
    counters.clear()
    logits, kept = _forward(model, batch), _kept(handle)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    counters.clear()
    again = _forward(model, batch)
    assert torch.equal(again, logits)
    return Compiled(graphs, breaks, counters["stats"]["unique_graphs"], logits, kept)


@pytest.fixture
def compiled_model():
    """Yields a function that compiles a model (dynamo's ``eager`` backend); the model is eager again
    and dynamo's caches are empty after the test."""
    compiled = []

    def compile_(model: torch.nn.Module) -> None:
        torch._dynamo.reset()
        model.compile(backend="eager")
        compiled.append(model)

    yield compile_
    for model in compiled:
        model._compiled_call_impl = None  # nn.Module.compile's own attribute: the eager model again
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def two_layers():
    return tiny_llava(text={"num_hidden_layers": 2})


def _vanilla(model: torch.nn.Module, batch: dict) -> Compiled:
    """The unpruned model's compiled prefill, counted; the model is eager again after it."""
    torch._dynamo.reset()
    model.compile(backend="eager")
    try:
        return _compiled(model, batch, None)
    finally:
        model._compiled_call_impl = None
        torch._dynamo.reset()


@pytest.fixture(scope="module")
def vanilla_two_layers(two_layers) -> Compiled:
    return _vanilla(two_layers, llava_batch(two_layers, batch_size=1).kwargs())


@pytest.mark.parametrize("order", ["compile, then apply", "apply, then compile"])
def test_a_compiled_pruned_prefill_breaks_where_vanilla_does_and_is_exact(
    two_layers, vanilla_two_layers, compiled_model, order
):
    model, vanilla = two_layers, vanilla_two_layers
    batch = llava_batch(model, batch_size=1).kwargs()
    options = {"method": "priortr", "budget": 4, "layer": 0}
    with priortr.apply(model, **options) as handle:
        eager_logits, eager_kept = _forward(model, batch), _kept(handle)
    assert eager_logits.shape[1] < vanilla.logits.shape[1]  # negative control: the eager model prunes
    if order == "compile, then apply":
        compiled_model(model)
        handle = priortr.apply(model, **options)
    else:
        handle = priortr.apply(model, **options)
        compiled_model(model)
    with handle:
        pruned = _compiled(model, batch, handle)
    _assert_within_vanillas_graphs(pruned, vanilla, stages=1)
    assert torch.equal(pruned.kept, eager_kept)
    torch.testing.assert_close(pruned.logits, eager_logits, rtol=0, atol=1e-10)
    assert torch.equal(pruned.logits.argmax(-1), eager_logits.argmax(-1))


def test_another_image_of_the_same_shape_runs_the_same_graphs_and_keeps_its_own_tokens(
    two_layers, compiled_model
):
    """The graphs read the plan and the stage's selection as tensors: a second image of the same shape
    compiles nothing and keeps what the eager model keeps for it (its own tokens, not the first's)."""
    model = two_layers
    first = llava_batch(model, batch_size=1).kwargs()
    second = {**first, "pixel_values": torch.randn_like(first["pixel_values"])}
    with priortr.apply(model, method="priortr", budget=4, layer=0) as handle:
        eager = [(_forward(model, batch), _kept(handle)) for batch in (first, second)]
        assert not torch.equal(eager[0][1], eager[1][1])  # negative control: the two keep different tokens
        compiled_model(model)
        _compiled(model, first, handle)
        counters.clear()
        logits, kept = _forward(model, second), _kept(handle)
        assert counters["stats"]["unique_graphs"] == 0
    assert torch.equal(kept, eager[1][1])
    torch.testing.assert_close(logits, eager[1][0], rtol=0, atol=1e-10)


def test_pruning_attached_after_a_compiled_vanilla_call_prunes(two_layers, compiled_model):
    """Dynamo does not guard on module hooks: graphs traced before ``apply`` would run without them.
    Attaching and removing pruning drop them, so the compiled model prunes, then is vanilla again."""
    model = two_layers
    batch = llava_batch(model, batch_size=1).kwargs()
    compiled_model(model)
    vanilla = _forward(model, batch)
    with priortr.apply(model, method="priortr", budget=4, layer=0):
        pruned = _forward(model, batch)
    assert pruned.shape[1] < vanilla.shape[1]
    assert torch.equal(_forward(model, batch), vanilla)


@pytest.fixture(scope="module")
def four_layers():
    return tiny_llava()


@pytest.fixture(scope="module")
def vanilla_four_layers(four_layers) -> Compiled:
    return _vanilla(four_layers, llava_batch(four_layers, batch_size=1).kwargs())


IN_GRAPHS = ("pdrop", "clse", "dart", "divprune", "visionzip", "prumerge+", "vispruner")
"""Methods of every kind whose stages run inside the graphs: multi-stage (PyramidDrop, CLSE), a DART
stage (its pivots' set order on the device), before the LLM on the embeddings (DivPrune) and on the
vision tower's [CLS] attention (VisionZip, PruMerge+, VisPruner: the tower's captures kept without the
thread's id in a compiled model)."""

OUT_OF_GRAPHS = ("random", "sparsevlm", "priortr+merge")
"""Methods whose stage leaves the graphs, exact all the same: ``random`` seeds a ``torch.Generator``
(which dynamo cannot make in a graph), SparseVLM's recycling and ``priortr+merge`` build their merge
groups on the host (``methods/groups.py``: a ``tolist`` per stage); docs/benchmarks.md has their counts."""


@pytest.mark.parametrize("method", IN_GRAPHS)
def test_methods_of_every_kind_compile_with_one_break_at_most_per_stage(
    four_layers, vanilla_four_layers, compiled_model, method
):
    model, vanilla = four_layers, vanilla_four_layers
    batch = llava_batch(model, batch_size=1).kwargs()
    with priortr.apply(model, method=method, budget=4) as handle:
        eager_logits, eager_kept = _forward(model, batch), _kept(handle)
        stages = len(handle.last.stages)
        compiled_model(model)
        pruned = _compiled(model, batch, handle)
    assert eager_logits.shape[1] < vanilla.logits.shape[1]  # negative control: the eager model prunes
    _assert_within_vanillas_graphs(pruned, vanilla, stages)
    assert torch.equal(pruned.kept, eager_kept)
    torch.testing.assert_close(pruned.logits, eager_logits, rtol=0, atol=1e-10)


@pytest.mark.parametrize("method", OUT_OF_GRAPHS)
def test_methods_whose_stage_leaves_the_graphs_are_exact_compiled(four_layers, compiled_model, method):
    model = four_layers
    batch = llava_batch(model, batch_size=1).kwargs()
    with priortr.apply(model, method=method, budget=4) as handle:
        eager_logits, eager_kept = _forward(model, batch), _kept(handle)
        compiled_model(model)
        logits, kept = _forward(model, batch), _kept(handle)
    assert torch.equal(kept, eager_kept)
    torch.testing.assert_close(logits, eager_logits, rtol=0, atol=1e-10)


def test_a_second_thread_on_a_compiled_model_is_refused_while_a_prefill_runs(two_layers, compiled_model):
    """A compiled hook serves every thread: a call of another thread while one thread's prefill is armed
    is refused with the fix named, not run on that prefill's hooks. The eager model serves both."""
    model = two_layers
    batch = llava_batch(model, batch_size=1).kwargs()
    with priortr.apply(model, method="priortr", budget=4, layer=0) as handle:
        engine = handle._engine
        engine._in_flight[-1] = []  # what another thread's armed prefill leaves while it runs
        eager = _forward(model, batch)  # negative control: the eager model tells the threads apart
        engine._in_flight[-1] = []
        compiled_model(model)
        with pytest.raises(RuntimeError, match="Give each thread its own model"):
            _forward(model, batch)
        engine._in_flight.pop(-1, None)
        torch.testing.assert_close(_forward(model, batch), eager, rtol=0, atol=1e-10)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_compiled_model_generates_the_eager_tokens(two_layers, compiled_model, cache):
    """generate() on the compiled model: the pruned prefill in its graphs, then decode steps on the pruned
    cache; a static cache's compaction (its one eager part, a break at the stage) included."""
    model = two_layers
    batch = llava_batch(model, batch_size=1).kwargs()
    options = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False, "cache_implementation": cache}
    with priortr.apply(model, method="priortr", budget=4, layer=0) as handle, torch.no_grad():
        eager = model.generate(**batch, **options)
        eager_kept = _kept(handle)
        compiled_model(model)
        compiled = model.generate(**batch, **options)
    assert torch.equal(compiled, eager)
    assert torch.equal(_kept(handle), eager_kept)


def test_layers_of_one_kind_given_different_rope_are_refused():
    """The kept tokens' RoPE and mask are gathered once per kind of layer (its window, whether it attends,
    its key length), which assumes transformers hands every layer of a kind the same objects; an eager
    prefill checks it. Negative control: a hook that gives decoder layer 2 its own copy of the RoPE."""
    model = tiny_llava(text={"num_hidden_layers": 3})
    batch = llava_batch(model, batch_size=1).kwargs()

    def own_copy(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        rope = tuple(part.clone() for part in kwargs["position_embeddings"])
        return args, {**kwargs, "position_embeddings": rope}

    with priortr.apply(model, method="priortr", budget=4, layer=0):
        _forward(model, batch)  # the same objects in every layer: accepted
        hook = model.model.language_model.layers[2].register_forward_pre_hook(own_copy, with_kwargs=True)
        try:
            with pytest.raises(NotImplementedError, match="decoder layer 2 received a RoPE or mask other"):
                _forward(model, batch)
        finally:
            hook.remove()
