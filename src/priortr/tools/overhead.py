"""What pruning adds to a prefill and to a decode step, counted: aten ops, host syncs, host-to-device
copies, hook calls.

On a GPU at batch 1-8 a prefill of a 7B model is tens of milliseconds and a decode step a few, mostly
kernel launches, so what the engine does on the host *is* the speed-up or its loss. Timings on a shared
CPU cannot show that; counts can, and they are deterministic (design notes, section 7). On a CPU every
tensor lives in one memory, so the counters follow where each tensor *would* live on a GPU:

* a tensor made from host data (``torch.tensor(data)``, a factory without ``device=``), a host copy
  (``.cpu()``, ``to_host``) and everything computed from such tensors alone lives on the host; the
  engine's host planning (``priortr.engine.plan.plan_on_host``) is host work throughout. Every other
  tensor (the model's inputs and weights, what they compute, factories given a ``device``) lives on
  the device (``_Places``, a ``TorchFunctionMode``: it sees the calls as written, ``device=`` included);
* every aten op is seen by a ``TorchDispatchMode``; non-view ops on the device approximate kernel
  launches, ops on the host are counted apart (``host_ops``);
* a *sync* is what ``torch.cuda.set_sync_debug_mode`` reports: a read of a device value (``.item()``,
  ``bool(t)``, ``nonzero``, bool-mask indexing, ``tolist``, ``.cpu()``, ``numpy``) and a blocking copy
  from the host (``torch.tensor(data, device=...)``, ``.to(device)`` without ``non_blocking=True``, a
  host tensor or a Python list indexing a device tensor);
* an *h2d* copy is one host-to-device transfer (a ``cudaMemcpyAsync``), blocking or queued.

Hook calls are counted as the hooks registered on every module that runs. ``measure`` runs
``generate()`` with and without pruning on the same inputs and reports the counts of the prefill (the
first model call) and of a decode step (``decode_step``).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

import priortr
from priortr.engine import plan as plan_module
from priortr.frontend import timing
from priortr.tensors import host as host_module

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
"""aten ops that read a device value back to the host."""
COPIES_TO_HOST = frozenset({"tolist", "cpu", "numpy"})
"""Tensor methods that copy a device tensor to the host without an aten op of their own."""
FROM_DATA = frozenset({"tensor", "as_tensor", "asarray"})
"""Factories that make a tensor from host data."""


@dataclass
class Counts:
    """What one model call dispatched. ``ops``: non-view aten ops on the device; ``host_ops``: ops on the
    host (host planning included); ``syncs``: what CUDA's sync debug mode would report; ``h2d``:
    host-to-device copies; ``hooks``: hook calls; ``seconds``: its median host time, where ``measure``
    timed it (uncounted runs)."""

    ops: int = 0
    host_ops: int = 0
    syncs: int = 0
    h2d: int = 0
    hooks: int = 0
    seconds: float = 0.0
    names: Counter = field(default_factory=Counter)
    sync_names: Counter = field(default_factory=Counter)
    h2d_names: Counter = field(default_factory=Counter)


class _Counter(TorchDispatchMode):
    """Counts aten ops into ``self.current`` (a ``Counts``): on the host or the device as ``places``
    says, reads of device values as syncs."""

    def __init__(self, places: _Places) -> None:
        super().__init__()
        self.current = Counts()
        self.places = places

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        current = self.current
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_host = self.places.host_call or (bool(tensors) and all(map(self.places.on_host, tensors)))
        if name not in VIEW_OPS:
            if on_host:
                current.host_ops += 1
            else:
                current.ops += 1
                current.names[name] += 1
        if not on_host and (
            name in READS or (name in ("index", "index_put", "index_put_") and _bool_index(args))
        ):
            self.sync(name)
        return func(*args, **(kwargs or {}))

    def sync(self, name: str) -> None:
        self.current.syncs += 1
        self.current.sync_names[name] += 1

    def h2d(self, name: str, blocking: bool) -> None:
        self.current.h2d += 1
        self.current.h2d_names[name] += 1
        if blocking:
            self.sync(f"{name} (blocking copy)")


class _Places(TorchFunctionMode):
    """Where each tensor would live on a GPU run (host or device, module docstring), and the copies
    between them that the calls it sees make; ``host_call`` is True while a call runs on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.counter: _Counter | None = None
        self.host_tensors: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.host_call = False
        self.planning = 0  # inside the engine's host planning: everything is host work

    def on_host(self, tensor: torch.Tensor) -> bool:
        return tensor in self.host_tensors

    def tag(self, outputs: Any, on_host: bool) -> None:
        for tensor in pytree.tree_leaves(outputs):
            if isinstance(tensor, torch.Tensor):
                if on_host:
                    self.host_tensors[tensor] = True
                else:
                    self.host_tensors.pop(tensor, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        subject = args[0] if args and isinstance(args[0], torch.Tensor) else None
        counter = self.counter
        if self.planning:
            return self._run(func, args, kwargs, on_host=True)
        if name in COPIES_TO_HOST and subject is not None:
            if not self.on_host(subject):
                counter.sync(name)
            return self._run(func, args, kwargs, on_host=True, fresh=True)
        if name in ("to", "cuda") and subject is not None:
            target = _target_device(args[1:], kwargs) if name == "to" else "cuda"
            if target is None:
                return self._run(func, args, kwargs, on_host=self.on_host(subject))
            if target == "cpu":
                if not self.on_host(subject):
                    counter.sync("to('cpu')")
                return self._run(func, args, kwargs, on_host=True, fresh=True)
            if self.on_host(subject):
                counter.h2d("to(device)", blocking=not kwargs.get("non_blocking", False))
            return self._run(func, args, kwargs, on_host=False, fresh=True)
        if not tensors or name in FROM_DATA:  # a factory: on the device only when told so
            device = kwargs.get("device")
            if name in FROM_DATA and device is not None:
                counter.h2d(f"torch.{name}(data, device=)", blocking=True)
            return self._run(func, args, kwargs, on_host=device is None)
        host = [t for t in tensors if self.on_host(t)]
        if len(host) == len(tensors) and not _device_kwarg(kwargs):
            return self._run(func, args, kwargs, on_host=True)
        for tensor in host:
            if tensor.ndim > 0:  # a host scalar is a kernel argument, not a copy
                counter.h2d(f"{name} (host tensor)", blocking=not kwargs.get("non_blocking", False))
        if name in ("__getitem__", "__setitem__") and _has_list_index(args[1] if len(args) > 1 else None):
            counter.h2d(f"{name} (list index)", blocking=True)
        return self._run(func, args, kwargs, on_host=False)

    def _run(self, func, args, kwargs, on_host: bool, fresh: bool = False) -> Any:
        outer, self.host_call = self.host_call, on_host
        try:
            out = func(*args, **kwargs)
        finally:
            self.host_call = outer
        if fresh and isinstance(out, torch.Tensor) and any(out is a for a in args):
            out = out.view_as(out)  # one memory on a CPU: a new tensor object carries the new place
        self.tag(out, on_host)
        return out


def _target_device(args: tuple, kwargs: dict) -> str | None:
    """The device type a ``Tensor.to`` call names (None: a dtype change only)."""
    for value in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(value, str) and value == "cpu":
            return "cpu"  # a host copy by name; a torch.device is the model's (one memory on a CPU)
        if isinstance(value, str | torch.device | torch.Tensor):
            return "device"
    return None


def _device_kwarg(kwargs: dict) -> bool:
    return kwargs.get("device") is not None


def _has_list_index(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, list) for part in parts)


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


@contextlib.contextmanager
def _patched(places: _Places) -> Iterator[None]:
    """Mark the engine's host planning and its one blocking copy of the prompt while the block runs."""
    originals: dict[tuple[Any, str], Any] = {}

    def patch(owner: Any, name: str, replacement: Callable) -> None:
        originals[(owner, name)] = getattr(owner, name)
        setattr(owner, name, replacement)

    to_host, plan_on_host = host_module.to_host, plan_module.plan_on_host

    def counted_to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        places.counter.sync("to_host")  # on a GPU: one blocking copy of the prompt
        copies = tuple(tensor.view_as(tensor) for tensor in to_host(*tensors))
        places.tag(copies, on_host=True)
        return copies

    def planned_on_host(*args: Any, **kwargs: Any) -> Any:
        places.planning += 1
        try:
            return plan_on_host(*args, **kwargs)
        finally:
            places.planning -= 1

    for module in [m for n, m in sys.modules.items() if n.startswith("priortr.") and m is not None]:
        if getattr(module, "to_host", None) is to_host:
            patch(module, "to_host", counted_to_host)
    patch(plan_module, "plan_on_host", planned_on_host)
    try:
        yield
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)


@contextlib.contextmanager
def counting() -> Iterator[_Counter]:
    """Within the block, count what torch runs into ``counter.current`` (replace it to start a new
    window). Tensors made before the block (the model's weights, its inputs) are on the device."""
    places = _Places()
    counter = _Counter(places)
    places.counter = counter
    with _patched(places), places, counter:
        yield counter


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
                (f"{phase}: host-to-device copies", vanilla.h2d, pruned.h2d),
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
        with torch.no_grad(), counting() as counter:
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
