"""What the engine adds to a decode step and a prefill, counted (``priortr.tools.overhead``): counts are
deterministic where timings are not, so the targets of GPU-grade decoding are asserted here.

A decode step on a pruned cache must dispatch what a vanilla decode step dispatches: no host sync,
at most two extra ops, no per-layer hook; torch.compile must make the same single graph of it. A
pruned prefill adds one sync and one host-to-device copy to vanilla's, whatever its stages do.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import priortr
from priortr.methods import get_rule
from priortr.methods.scoring import build_evidence, select_top_k
from priortr.methods.value_checks import value_checks_enabled
from priortr.tensors.host import to_device_once
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


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("method", ["priortr", "fastv", "pdrop"])
def test_a_pruned_prefill_adds_one_sync_and_one_copy(llava, method, batch_size):
    """The engine's host work at vanilla's level (issue 47): one blocking copy of the prompt to plan it
    (``to_host``), one queued copy of the whole plan back (``to_device_once``), nothing else read back or
    sent while its stages run. On a GPU: one more sync and one more host-to-device copy than vanilla."""
    batch = llava_batch(llava, batch_size=batch_size)
    vanilla, _ = _counts(llava, batch, "dynamic")
    prefill, _ = _counts(llava, batch, "dynamic", method=method, budget=4, layer=METHODS[method])
    assert prefill.sync_names - vanilla.sync_names == Counter({"to_host": 1})
    assert prefill.syncs - vanilla.syncs == 1
    assert prefill.h2d_names - vanilla.h2d_names == Counter({"to(device)": 1})
    assert prefill.h2d - vanilla.h2d == 1
    budget = 80 if method != "pdrop" else 280  # PyramidDrop ranks at three layers
    assert prefill.ops - vanilla.ops <= budget * batch_size, prefill.names - vanilla.names


def test_the_counter_follows_where_tensors_would_live():
    """Hand-counted: what would be a sync or a host-to-device copy on a GPU, and negative controls
    (host work, and device work that reads nothing back, count nothing)."""
    weights = torch.arange(4.0)  # made before counting: on the device, like a model's weights
    with overhead.counting() as counter:
        index = torch.tensor([0, 2])  # host data
        host_mask = torch.zeros(4, dtype=torch.bool)  # a factory without device=: host
        int(index.sum()), index.tolist(), host_mask.any().item()  # host work: nothing
        weights[index]  # a host index on a device tensor: a blocking copy
        weights.tolist()  # a read
        moved, flags = to_device_once([index, host_mask], weights.device)  # one queued copy
        weights[moved] * 2, torch.where(flags, weights, 0)  # device work: nothing
        torch.tensor([1.0], device=weights.device)  # a blocking copy
        (weights > 1).nonzero()  # a read
        bool(weights.sum() > 0)  # a read
        torch.arange(3, device=weights.device) + weights[:3]  # device work: nothing
    counts = counter.current
    assert counts.sync_names == Counter(
        {
            "__getitem__ (host tensor) (blocking copy)": 1,
            "tolist": 1,
            "torch.tensor(data, device=) (blocking copy)": 1,
            "nonzero": 1,
            "_local_scalar_dense": 1,
        }
    )
    assert counts.h2d == 3 and counts.syncs == 5
    assert counts.host_ops > 0


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
