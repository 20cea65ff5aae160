"""What pruning adds to a prefill and to a decode step, counted: aten ops, host syncs, hook calls.

On a GPU at batch 1-8 a prefill of a 7B model is tens of milliseconds and a decode step a few, mostly
kernel launches, so what the engine does on the host *is* the speed-up or its loss. Timings on a shared
CPU cannot show that; counts can, and they are deterministic (design notes, section 7):

* every aten op is seen by a ``TorchDispatchMode``; non-view ops approximate kernel launches;
* a host sync is an op that reads a device value back (``.item()``, ``bool(t)``, ``nonzero``,
  bool-mask indexing) or an explicit device-to-host copy (``tolist``, ``cpu``, ``numpy``);
* the engine's host planning (``priortr.engine.plan.plan_on_host``) works on a host copy of the prompt
  and launches no kernel on a GPU: its ops are counted apart, as host ops, and its one copy of the
  prompt as one sync;
* hook calls are counted as the hooks registered on every module that runs.

``measure`` runs ``generate()`` with and without pruning on the same inputs and reports the counts of
the prefill (the first model call) and of a decode step (``decode_step``).
"""

from __future__ import annotations

import contextlib
import statistics
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import priortr
from priortr.engine import plan as plan_module
from priortr.tools import timing

VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "expand",
        "slice",
        "select",
        "transpose",
        "t",
        "unsqueeze",
        "squeeze",
        "permute",
        "as_strided",
        "alias",
        "detach",
        "empty",
        "empty_strided",
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
        "narrow",
        "lift_fresh",
        "_reshape_alias",
        "reshape",
        "flatten",
        "unflatten",
        "view_as",
        "expand_as",
        "diagonal",
        "set_",
        "resize_",
    }
)
READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "nonzero_static", "item"})


@dataclass
class Counts:
    """What one model call dispatched. ``ops``: non-view aten ops outside host planning; ``host_ops``:
    ops of the host planning; ``syncs``: reads of device values plus host copies; ``hooks``: hook calls;
    ``seconds``: its median host time, where ``measure`` timed it (uncounted runs)."""

    ops: int = 0
    host_ops: int = 0
    syncs: int = 0
    hooks: int = 0
    seconds: float = 0.0
    names: Counter = field(default_factory=Counter)
    sync_names: Counter = field(default_factory=Counter)


class _Counter(TorchDispatchMode):
    """Counts aten ops into ``self.current`` (a ``Counts``), ops in host planning apart."""

    def __init__(self) -> None:
        super().__init__()
        self.current = Counts()
        self.host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        current = self.current
        if name not in VIEW_OPS:
            if self.host:
                current.host_ops += 1
            else:
                current.ops += 1
                current.names[name] += 1
        if not self.host and (
            name in READS or (name in ("index", "index_put", "index_put_") and _bool_index(args))
        ):
            current.syncs += 1
            current.sync_names[name] += 1
        return func(*args, **(kwargs or {}))

    def sync(self, name: str) -> None:
        if not self.host:
            self.current.syncs += 1
            self.current.sync_names[name] += 1


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


@contextlib.contextmanager
def _patched(counter: _Counter) -> Iterator[None]:
    """Count host copies, and mark the engine's host planning, while the block runs."""
    originals: dict[tuple[Any, str], Any] = {}

    def patch(owner: Any, name: str, wrapper: Callable[[Callable], Callable]) -> None:
        originals[(owner, name)] = getattr(owner, name)
        setattr(owner, name, wrapper(originals[(owner, name)]))

    def copy(name: str) -> Callable[[Callable], Callable]:
        def wrap(fn: Callable) -> Callable:
            def wrapped(*args, **kwargs):
                counter.sync(name)
                return fn(*args, **kwargs)

            return wrapped

        return wrap

    def host(fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            counter.sync("to_host")  # on a GPU: the one blocking copy of the prompt
            counter.host += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.host -= 1

        return wrapped

    for name in ("tolist", "cpu", "numpy"):
        patch(torch.Tensor, name, copy(name))
    patch(plan_module, "plan_on_host", host)
    try:
        yield
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


@dataclass
class Overhead:
    """Counts of the prefill and of one decode step, vanilla and pruned."""

    prefill: Counts
    decode: Counts
    vanilla_prefill: Counts
    vanilla_decode: Counts

    def rows(self) -> list[tuple[str, int | float, int | float]]:
        """(what, vanilla, pruned) rows of the comparison table."""
        out = []
        for phase, vanilla, pruned in (
            ("prefill", self.vanilla_prefill, self.prefill),
            ("decode step", self.vanilla_decode, self.decode),
        ):
            out += [
                (f"{phase}: non-view aten ops", vanilla.ops, pruned.ops),
                (f"{phase}: host-planning ops", vanilla.host_ops, pruned.host_ops),
                (f"{phase}: host syncs", vanilla.syncs, pruned.syncs),
                (f"{phase}: hook calls", vanilla.hooks, pruned.hooks),
                (f"{phase}: host ms (median)", vanilla.seconds * 1e3, pruned.seconds * 1e3),
            ]
        return out

    def markdown(self) -> str:
        lines = ["| | vanilla | pruned | added |", "| --- | --- | --- | --- |"]
        for what, vanilla, pruned in self.rows():
            fmt = "{:.2f}" if isinstance(vanilla, float) else "{}"
            added = pruned - vanilla
            lines.append(f"| {what} | {fmt.format(vanilla)} | {fmt.format(pruned)} | {fmt.format(added)} |")
        return "\n".join(lines)


def count_generate(
    model: torch.nn.Module, inputs: dict, new_tokens: int = 3, **generate_kwargs
) -> list[Counts]:
    """Counts of every model call of ``model.generate(**inputs)`` (the prefill first)."""
    counter = _Counter()
    calls: list[Counts] = []

    def on_call(module, args):
        counter.current = Counts()
        calls.append(counter.current)

    def on_module(module, args):
        if module is not model:  # the outer model carries this function's own hook
            counter.current.hooks += len(module._forward_pre_hooks) + len(module._forward_hooks)

    handles = [
        model.register_forward_pre_hook(on_call, prepend=True),
        torch.nn.modules.module.register_module_forward_pre_hook(on_module),
    ]
    try:
        with torch.no_grad(), _patched(counter), counter:
            model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                **generate_kwargs,
            )
    finally:
        for handle in handles:
            handle.remove()
    return calls


def decode_step(calls: list[Counts]) -> Counts:
    """The counts of a decode step of ``count_generate``: the first one. The last call's window runs on
    until generate() returns, so it also holds what runs after the last step (priortr's check of the
    prefill's scores, ``PruningEngine``), which no decode step pays."""
    return calls[1]


def _median_call_seconds(
    model: torch.nn.Module, inputs: dict, repeats: int, **generate_kwargs
) -> tuple[float, float]:
    """Median wall time of the prefill and of the last decode step over ``repeats`` generate() runs."""
    prefill, decode = [], []
    for _ in range(repeats):
        with timing.forward_calls_ms(model) as calls, torch.no_grad():
            model.generate(**inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False, **generate_kwargs)
        prefill.append(calls[0] / 1e3)
        decode.append(calls[-1] / 1e3)
    return statistics.median(prefill), statistics.median(decode)


def measure(
    model: torch.nn.Module,
    inputs: dict,
    repeats: int = 5,
    generate_kwargs: dict | None = None,
    **apply_kwargs: Any,
) -> Overhead:
    """Counts (and median host times) of ``model.generate(**inputs)`` without and with
    ``priortr.apply(model, **apply_kwargs)``: the prefill and a decode step (``decode_step``)."""
    generate_kwargs = generate_kwargs or {}
    vanilla = count_generate(model, inputs, **generate_kwargs)
    vanilla_times = _median_call_seconds(model, inputs, repeats, **generate_kwargs)
    with priortr.apply(model, **apply_kwargs):
        pruned = count_generate(model, inputs, **generate_kwargs)
        pruned_times = _median_call_seconds(model, inputs, repeats, **generate_kwargs)
    vanilla[0].seconds, decode_step(vanilla).seconds = vanilla_times
    pruned[0].seconds, decode_step(pruned).seconds = pruned_times
    return Overhead(
        prefill=pruned[0],
        decode=decode_step(pruned),
        vanilla_prefill=vanilla[0],
        vanilla_decode=decode_step(vanilla),
    )


def compiled_generate(
    model: torch.nn.Module, inputs: dict, backend: Any = "eager", **generate_kwargs
) -> torch.Tensor:
    """``model.generate(**inputs)`` with a static cache and its decode step compiled with
    ``fullgraph=True`` (transformers compiles decode only), on any device; a graph break raises."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, backend=backend)
    config._compile_all_devices = True  # transformers' own switch to compile on CPU too (private)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            return model.generate(
                **inputs, cache_implementation="static", compile_config=config, **generate_kwargs
            )
    finally:
        torch._dynamo.reset()


def count_compiled_graphs(model: torch.nn.Module, inputs: dict, new_tokens: int = 4) -> int:
    """Graphs torch.compile makes of ``new_tokens`` decode steps (1: no recompilation, no break)."""
    graphs = 0

    def backend(graph_module, example_inputs, **options):
        nonlocal graphs
        graphs += 1
        return graph_module.forward

    compiled_generate(
        model, inputs, backend=backend, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )
    return graphs
