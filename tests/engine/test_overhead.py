"""What the engine adds to a decode step and a prefill, counted (``priortr.tools.overhead``): counts are
deterministic where timings are not, so the targets of GPU-grade decoding are asserted here.

A decode step on a pruned cache must dispatch what a vanilla decode step dispatches: no host sync,
at most two extra ops, no per-layer hook; torch.compile must make the same single graph of it.
"""

from __future__ import annotations

import pytest
import torch

import priortr
from priortr.methods import get_rule
from priortr.methods.scoring import build_evidence, select_top_k
from priortr.methods.value_checks import value_checks_enabled
from priortr.tools import overhead
from tests.helpers.tiny import llava_batch, tiny_llava

METHODS = {"priortr": 1, "fastv": 1, "pdrop": None, "divprune": None}  # one-layer, multi-stage, pre-LLM


@pytest.fixture(scope="module")
def llava():
    return tiny_llava(dtype=torch.float32)


def _counts(model, batch, cache: str, **apply_kwargs) -> tuple[overhead.Counts, overhead.Counts]:
    kwargs = {"cache_implementation": cache}
    if not apply_kwargs:
        calls = overhead.count_generate(model, batch.kwargs(), **kwargs)
    else:
        with priortr.apply(model, **apply_kwargs):
            calls = overhead.count_generate(model, batch.kwargs(), **kwargs)
    return calls[0], overhead.decode_step(calls)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("method", METHODS)
def test_a_decode_step_costs_what_a_vanilla_one_does(llava, method, cache):
    batch = llava_batch(llava, batch_size=1)
    _, vanilla = _counts(llava, batch, cache)
    prefill, decode = _counts(llava, batch, cache, method=method, budget=4, layer=METHODS[method])
    assert decode.syncs == vanilla.syncs, decode.sync_names - vanilla.sync_names
    assert decode.ops - vanilla.ops <= 2, decode.names - vanilla.names
    assert decode.hooks <= 1, "only the model's pre-hook may run in a decode step"
    assert prefill.hooks > decode.hooks, "negative control: the prefill does run the armed hooks"


def test_a_pruned_prefill_syncs_at_most_twice_more(llava):
    """One host copy of the prompt to plan, nothing read back while the stages run (the issue's targets
    for batch 1: at most 2 extra syncs and 80 extra non-view ops)."""
    batch = llava_batch(llava, batch_size=1)
    vanilla, _ = _counts(llava, batch, "dynamic")
    prefill, _ = _counts(llava, batch, "dynamic", method="priortr", budget=4, layer=1)
    assert prefill.syncs - vanilla.syncs <= 2, prefill.sync_names - vanilla.sync_names
    assert prefill.sync_names["to_host"] == 1
    assert prefill.ops - vanilla.ops <= 80, prefill.names - vanilla.names


def test_strict_turns_value_checks_back_on(llava):
    """Negative control for the sync counts: the checks that read values run under strict=True."""
    batch = llava_batch(llava, batch_size=1)
    relaxed, _ = _counts(llava, batch, "dynamic", method="priortr", budget=4, layer=1)
    strict, _ = _counts(llava, batch, "dynamic", method="priortr", budget=4, layer=1, strict=True)
    assert strict.syncs > relaxed.syncs


@pytest.mark.parametrize("method", ["priortr", "pdrop"])
def test_compiled_decode_is_one_graph_with_the_eager_tokens(llava, method):
    batch = llava_batch(llava, batch_size=1)
    vanilla = overhead.count_compiled_graphs(llava, batch.kwargs())
    options = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
    with priortr.apply(llava, method=method, budget=4, layer=METHODS[method]), torch.no_grad():
        eager = llava.generate(**batch.kwargs(), cache_implementation="static", **options)
        assert overhead.count_compiled_graphs(llava, batch.kwargs()) == vanilla == 1
        compiled = overhead.compiled_generate(llava, batch.kwargs(), **options)
    assert torch.equal(compiled, eager)


def test_the_pure_part_of_a_stage_compiles_in_one_graph():
    """Scores -> top-K, as the engine runs them (value checks off), trace with fullgraph=True."""

    def stage(prior, posterior, valid, last):
        evidence = build_evidence(prior, posterior, valid, last)
        return select_top_k(get_rule("priortr").rule(evidence), 4)

    generator = torch.Generator().manual_seed(0)
    args = (
        torch.rand(2, 4, 16, generator=generator),
        torch.rand(2, 4, 5, 16, generator=generator),
        torch.ones(2, 5, dtype=torch.bool),
        torch.rand(2, 4, 16, generator=generator),
    )
    torch._dynamo.reset()
    with value_checks_enabled(False):
        compiled = torch.compile(stage, fullgraph=True, backend="eager")(*args)
    torch._dynamo.reset()
    assert torch.equal(compiled, stage(*args))
