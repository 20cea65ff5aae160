"""The hook wiring: how a prefill and the calls after it reach the engine's parts.

One permanent pre-hook on the multimodal model sees every call. A call that continues a pruned cache
(a decode step, a later chat turn) is adjusted by the cache's ledger (``ledger.continue_call``) and
nothing else runs. A prefill that brings images is planned on the host (``plan.make_plan``); only then
are hooks armed, on the decoder layers a stage needs and the projections of the layers it scores, and
they are disarmed as soon as the model returns. Decode steps therefore run no per-layer hook at all.
Armed hooks serve only the thread whose prefill armed them, so calls from other threads pass through.

Under ``model.compile()`` the hooks run inside dynamo's graphs: the planning and arming run eagerly
(``_prefill_call``, behind ``torch.compiler.disable``: the prompt read on the host, the thread's id, the
hooks' registration), the rest (the armed hooks, the stages) is traced. A compiled hook cannot read the
thread's id, so a second thread's call on a compiled model while a prefill is armed is refused.

A call may carry a continuation after its prompt (``continuation``): where the prompt ends is known per
thread, set by ``PruningHandle.prompt_ends`` and, for the length of a ``generate()`` call, by generate
itself (its input is the prompt), so that generate() without a cache, assisted decoding and answers
scored in one forward pass run as cached, pruned decoding runs them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from priortr import compat
from priortr.adapters import FamilyAdapter
from priortr.adapters.base import VisionProbe
from priortr.engine.config import BEFORE_LLM, VISION_NEEDS, DegenerateScoresWarning, PruningConfig
from priortr.engine.continuation import Continuation, split_call
from priortr.engine.ledger import CacheLedger, continue_call, ledger_of, write_ledger
from priortr.engine.plan import PrefillPlan, make_plan, skip_prefill
from priortr.engine.prefill import Prefill, StageObserver
from priortr.engine.result import PrefillRecord, PruneResult
from priortr.methods.scoring import NO_WEIGHT_FIX
from priortr.tensors.host import to_host

COMPILED_CAPTURES = -1
"""The key of the vision tower's captures in a compiled model, in place of a thread's id
(``PruningEngine._captures_key``)."""


class PruningEngine:
    """Hooks physical visual-token pruning into one model; ``detach()`` restores it exactly.

    Per-call state lives with the call: a prefill's hooks serve only the thread that armed them, and a
    pruned cache carries its own ledger, so several threads may run one model at once (each with its
    own inputs and cache). ``last`` is engine-wide: the most recent pruned prefill of any thread.
    """

    def __init__(self, model: nn.Module, adapter: FamilyAdapter, config: PruningConfig) -> None:
        self.model = model
        self.adapter = adapter
        self.config = config
        self.multimodal = adapter.multimodal_model(model)
        self.layers = adapter.decoder_layers(model)
        self.attention_layers = frozenset(adapter.attention_layers(model))
        self.windows = compat.layers.windows(model.config.get_text_config())
        self.vision = adapter.vision_probe(model) if config.method.needs & VISION_NEEDS else None
        self.kv_shared = adapter.kv_shared_layers(model)
        self.calls, self.layer_calls = compat.calls.resolve(
            self.multimodal, self.layers, adapter.language_model(model)
        )
        self.scaled_queries = {  # layer index -> attention that scales its queries by their places
            index: adapter.attention(self.layers[index])
            for index in sorted(self.attention_layers)
            if adapter.scales_queries(adapter.attention(self.layers[index]))
        }
        self.explicit_mask = compat.masks.explicit_mask_builder(compat.masks.implementation(model))
        self._vision_captures: dict[int, dict[str, torch.Tensor]] = {}  # per thread (_captures_key)
        self._in_flight: dict[int, list[RemovableHandle]] = {}  # per thread: the armed prefill's hooks
        self._prompt_ends: dict[int, int] = {}  # per thread: the columns of a call's prompt
        self._stage_observers: list[StageObserver] = []
        self._record: PrefillRecord | None = None
        self._unchecked: PrefillRecord | None = None  # the latest prefill, its scores not yet checked
        self._warned_degenerate = False
        self._last: PruneResult | None = None
        self._permanent: list[RemovableHandle] = []
        self._loss: Callable | None = None
        self._generate: Callable | None = None

    def __reduce_ex__(self, protocol: object) -> Any:
        raise TypeError(
            "a model with priortr pruning attached cannot be pickled or deep-copied (its hooks belong to "
            "this model); call handle.remove() first, copy or save the model (or save_pretrained / "
            "state_dict), then priortr.apply() to the copy"
        )

    @property
    def attached(self) -> bool:
        return bool(self._permanent)

    @property
    def _compiled(self) -> bool:
        """Whether the model runs compiled graphs (``nn.Module.compile`` on it or its multimodal model)."""
        return any(module._compiled_call_impl is not None for module in (self.model, self.multimodal))

    @property
    def last(self) -> PruneResult | None:
        """What the most recent pruned prefill kept (``PruneResult``), built when first read."""
        self._warn_on_degenerate_scores()
        record = self._record
        if record is not None:
            self._last, self._record = record.result(), None
        return self._last

    def _warn_on_degenerate_scores(self) -> None:
        """Warn, once per attach, when the latest pruned prefill ranked an image on NaN or all-zero scores
        (its kept tokens are then the first ones, not a ranking; ``strict=True`` refuses it). Read after
        generate() returns or when ``last`` is read, never while the model runs."""
        record, self._unchecked = self._unchecked, None
        if record is None or self._warned_degenerate or not record.has_degenerate_scores():
            return
        self._warned_degenerate = True
        warnings.warn(
            f"priortr: {self.config.method.name} ranked an image on scores that are NaN or all zero, so it "
            f"kept the image's first tokens: {NO_WEIGHT_FIX} (strict=True refuses such a prompt)",
            DegenerateScoresWarning,
            stacklevel=3,
        )

    def attach(self) -> None:
        _forget_compiled_code()
        self._permanent = [self.multimodal.register_forward_pre_hook(self._on_model_call, with_kwargs=True)]
        if "_loss_function" not in vars(self.model) and hasattr(type(self.model), "loss_function"):
            self._loss = self.model.loss_function  # called only with labels=: never on a decode step
            self.model.loss_function = self._loss_on_pruned_logits
        self._permanent += [
            attention.register_forward_pre_hook(_places_in_prompt, with_kwargs=True)
            for attention in self.scaled_queries.values()
        ]
        if self.vision is not None:
            self._permanent += vision_hooks(self.vision, self.config.method.needs, self._on_vision_output)
        if "generate" not in vars(self.model) and hasattr(self.model, "generate"):
            self._generate = self.model.generate
            self.model.generate = functools.wraps(self._generate)(
                functools.partial(self._generate_from_prompt)  # a partial can take generate()'s name, doc
            )

    def detach(self) -> None:
        for thread in list(self._in_flight):
            _disarm(self._in_flight.pop(thread, []))
        for handle in self._permanent:
            handle.remove()
        self._permanent = []
        self._vision_captures = {}
        if self._loss is not None:
            del self.model._loss_function  # the model's own loss_function again
            self._loss = None
        if self._generate is not None:
            del self.model.generate  # the class's generate again
            self._generate = None
        _forget_compiled_code()

    @contextlib.contextmanager
    def prompt_ends(self, at: int) -> Iterator[None]:
        """Within the block, this thread's calls hold a prompt in their first ``at`` columns and a
        continuation after it (``continuation``)."""
        thread = threading.get_ident()
        outer = self._prompt_ends.get(thread)
        self._prompt_ends[thread] = at
        try:
            yield
        finally:
            if outer is None:
                del self._prompt_ends[thread]
            else:
                self._prompt_ends[thread] = outer

    @contextlib.contextmanager
    def observe_stages(self, observer: StageObserver) -> Iterator[None]:
        """Within the block, prefills that start call ``observer`` around each stage's work."""
        self._stage_observers.append(observer)
        try:
            yield
        finally:
            self._stage_observers.remove(observer)

    def _generate_from_prompt(self, *args: Any, **kwargs: Any) -> Any:
        """The model's generate(), whose input is the prompt: the calls it makes carry a continuation
        after it when it runs without a cache or verifies an assistant's candidates."""
        prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        stated = threading.get_ident() in self._prompt_ends  # the caller's own prompt_ends comes first
        if stated or not isinstance(prompt, torch.Tensor) or prompt.ndim != 2:
            out = self._generate(*args, **kwargs)
        else:
            with self.prompt_ends(prompt.shape[1]):
                out = self._generate(*args, **kwargs)
        self._warn_on_degenerate_scores()
        return out

    def _loss_on_pruned_logits(self, logits: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
        """The model's loss, refused with a clear message when pruning shortened the logits."""
        if logits.shape[1] != labels.shape[1]:
            raise ValueError(
                f"labels= cannot be used with pruning attached: the pruned forward returns logits for "
                f"{logits.shape[1]} of the {labels.shape[1]} labelled tokens (handle.last.positions says "
                "which), so transformers cannot align them. Compute the loss from out.logits and "
                "labels.gather(1, handle.last.positions), or run the forward after handle.remove()"
            )
        return self._loss(logits=logits, labels=labels, **kwargs)

    def _on_model_call(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Every call of the multimodal model, as a diagram: a call on a pruned cache continues it (decode
        steps, later chat turns); a prefill with images is planned, gets its ``Prefill`` and its hooks; any
        other call runs as it is (None)."""
        call = self.calls.call(args, kwargs)
        ledger = ledger_of(call.cache)
        decode_step = call.new_tokens == 1 and (ledger is not None or not call.has_visual_inputs)
        if decode_step and ledger is None:
            return None  # a decode step on a cache that was not pruned
        # A decode step reads nothing back; a longer call reads a static cache's length (a prefill or turn).
        empty = not decode_step and (call.cache is None or compat.cache.length(call.cache) == 0)
        if ledger is not None and not empty:
            return self._continue(call, ledger)
        return self._prefill_call(call, ledger, empty)

    @torch.compiler.disable
    def _prefill_call(
        self, call: compat.calls.ModelCall, ledger: CacheLedger | None, empty: bool
    ) -> tuple[tuple, dict] | None:
        """A call that is not a decode step or a turn on a pruned cache: a prefill to plan and arm, or a
        call that runs as it is. Eager in a compiled model too (its one graph break before the prefill):
        the plan's host work, the thread's id and the hooks' registration stay out of the graphs."""
        if ledger is not None:
            write_ledger(call.cache, None)  # the cache was reset for a new prompt
        if empty and call.cache is not None:
            compat.cache.restore_slots(call.cache)  # a static cache a pruned prefill shortened: full again
        thread = threading.get_ident()
        if thread in self._in_flight:
            _disarm(self._in_flight.pop(thread))  # a prefill of this thread raised before its return hook
        if self._in_flight and self._compiled:
            raise RuntimeError(
                "priortr: another thread's pruned prefill is running on this compiled model; its graphs "
                "would run that prefill's hooks in this call too (torch.compile does not guard on module "
                "hooks, and a compiled hook cannot tell threads apart). Give each thread its own model, "
                "or run the threads' calls one at a time"
            )
        if not (empty and call.has_visual_inputs):
            if empty:
                skip_prefill(
                    self.config, "the call brings no images, so the prompt has no image tokens to prune"
                )
            return None  # no prefill to plan (images on a cache this engine did not prune run as they are)
        return self._start_prefill(call, thread)

    def _continue(self, call: compat.calls.ModelCall, ledger: CacheLedger) -> tuple[tuple, dict]:
        """A decode step or a later chat turn on a pruned cache: the call adjusted by the cache's ledger."""
        compat.cache.check_unspoiled(call.cache)
        continue_call(ledger, call, self.adapter, self.model, self.config.strict)
        compat.cache.claim(call.cache)
        return call.hook_result()

    def _start_prefill(self, call: compat.calls.ModelCall, thread: int) -> tuple[tuple, dict] | None:
        """A prefill with images on an empty cache: split off a continuation after the prompt, plan the
        prompt, make its ``Prefill`` and arm its hooks (None: it runs unpruned)."""
        if call.has_raw_pixels:  # the tower runs inside this call; generate() runs it before
            self._vision_captures.pop(self._captures_key(thread), None)
        whole, continuation = call, None
        end = self._prompt_ends.get(thread)
        if end is not None and end < call.new_tokens and call.input_ids is not None:
            call, continuation = self._split_prompt(call, end)
        plan = make_plan(self.adapter, self.model, self.config, call, len(self.layers))
        if plan is None:
            return None
        prefill = self._prefill(plan, thread)
        self._last = None
        self._record = self._unchecked = prefill.record
        if not plan.stages:  # nothing to prune: the call runs whole
            prefill.finish()
            return whole.hook_result()
        self._in_flight[thread] = self._arm(prefill, thread, continuation)
        call.run_every_row()
        return call.hook_result()

    def _split_prompt(
        self, call: compat.calls.ModelCall, end: int
    ) -> tuple[compat.calls.ModelCall, Continuation]:
        """The prompt (the first ``end`` columns of ``call``) and the text continuation after it."""
        (rest,) = to_host(call.input_ids[:, end:])
        if self.adapter.visual_items(self.model.config, rest):
            raise ValueError(
                f"the call has image tokens after column {end}, where prompt_ends says its prompt "
                "ends: the prompt holds every image, the continuation after it is text"
            )
        return split_call(call, end, self.model)

    def _prefill(self, plan: PrefillPlan, thread: int) -> Prefill:
        """The ``Prefill`` of ``plan``: the vision tower's captures of this thread, the final norm if the
        method reads it, the model's mask builder, attention layers, local windows and stage observers."""
        vision = None
        if self.vision is not None:
            vision = (self.vision, self._vision_captures.setdefault(self._captures_key(thread), {}))
        norm = self.adapter.final_norm(self.model) if "final_norm" in self.config.method.needs else None
        return Prefill(
            plan,
            self.config,
            self.adapter,
            vision,
            self.explicit_mask,
            norm,
            self.attention_layers,
            self.windows,
            self._stage_observers,
            self.kv_shared,
        )

    def _arm(self, prefill: Prefill, thread: int, continuation: Continuation | None) -> list[RemovableHandle]:
        """Hooks for this prefill only, serving only ``thread``: a pre-hook on every layer from the first
        stage on, the q/k projections of each scored layer (attention methods), the first layer's
        input (methods that read the input embeddings), and the model's return (which runs the
        ``continuation`` of the call, if it has one)."""
        stages = prefill.plan.stages
        armed = []
        if prefill.reads_embeddings:
            armed.append(
                self.layers[0].register_forward_pre_hook(
                    _capture_input(prefill, thread, self.layer_calls), with_kwargs=True
                )
            )
        for index in range(max(stages[0], 0), len(self.layers)):
            hook = _before_layer(prefill, index, thread, self.layer_calls)
            armed.append(self.layers[index].register_forward_pre_hook(hook, with_kwargs=True))
        if self.config.method.needs & {"attention", "keys"}:
            for index in (layer for layer in stages if layer != BEFORE_LLM):
                attention = self.adapter.attention(self.layers[index])
                armed += [
                    self.adapter.query_projection(attention).register_forward_hook(
                        _keep_output(prefill.keep_queries, thread)
                    ),
                    self.adapter.key_projection(attention).register_forward_hook(
                        _keep_output(prefill.keep_keys, thread)
                    ),
                ]
        for index, attention in self.scaled_queries.items():
            if index > stages[0]:
                projection = self.adapter.query_projection(attention)
                armed.append(projection.register_forward_hook(_rescale(prefill, attention, thread)))
        returned = self._on_model_return(prefill, thread, continuation)
        armed.append(self.multimodal.register_forward_hook(returned, always_call=True))
        return armed

    def _on_model_return(self, prefill: Prefill, thread: int, continuation: Continuation | None) -> Callable:
        @torch.compiler.disable  # eager in a compiled model too: hooks are removed, the ledger written
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if threading.get_ident() != thread:
                return None
            _disarm(self._in_flight.pop(thread, []))
            self._vision_captures.pop(self._captures_key(thread), None)
            if prefill.ledger is not None:
                write_ledger(prefill.cache, prefill.ledger)
            if continuation is None or output is None:  # None: the prefill raised
                return None
            return continuation.run(module, output)

        return hook

    def _on_vision_output(self, name: str, tensor: torch.Tensor) -> None:
        self._vision_captures.setdefault(self._captures_key(), {})[name] = tensor

    def _captures_key(self, thread: int | None = None) -> int:
        """Where the vision tower's captures for ``thread``'s calls (None: the calling thread's) are
        kept: under the thread's id, or in a compiled model under ``COMPILED_CAPTURES`` (its hooks run
        in graphs, which cannot read a thread's id, and it serves one prefill at a time)."""
        if self._compiled:
            return COMPILED_CAPTURES
        return threading.get_ident() if thread is None else thread


def vision_hooks(
    probe: VisionProbe, needs: frozenset[str], keep: Callable[[str, torch.Tensor], None]
) -> list[RemovableHandle]:
    """Permanent hooks handing ``keep`` the tensors ``needs`` asks for each time the vision tower runs:
    the feature layer's q/k (``vision``), the last layer's q/k (``vision_last``) and the projector's
    input (``features``). They only keep references; the stage reads them once per prefill."""

    def output_of(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            keep(name, output)

        return hook

    def input_of(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            keep(name, args[0])

        return hook

    handles = []
    if "vision" in needs:
        handles += [
            probe.query_projection.register_forward_hook(output_of("q")),
            probe.key_projection.register_forward_hook(output_of("k")),
        ]
    if "vision_last" in needs:
        handles += [
            probe.last_query_projection.register_forward_hook(output_of("q_last")),
            probe.last_key_projection.register_forward_hook(output_of("k_last")),
        ]
    if "features" in needs:
        handles.append(probe.projector.register_forward_pre_hook(input_of("features")))
    return handles


def _forget_compiled_code() -> None:
    """Drop the code torch.compile made in this process (``torch.compiler.reset``) when it may have made
    some: dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``), so
    a model compiled and run before ``attach`` would go on running its graphs without pruning, and after
    ``detach`` with it. The next call of any compiled model traces again."""
    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()


def _serves(thread: int) -> bool:
    """Whether an armed hook serves the running call: in the thread whose prefill armed it, and always
    inside a compiled graph (dynamo cannot trace a thread's id)."""
    return torch.compiler.is_compiling() or threading.get_ident() == thread


def _disarm(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


def _before_layer(
    prefill: Prefill, index: int, thread: int, contract: compat.calls.LayerContract
) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not _serves(thread):
            return None  # another thread's call through the same layer
        call = contract.call(args, kwargs)
        prefill.before_layer(index, module, call)
        return call.hook_result()

    return hook


def _keep_output(keep: Callable[[torch.Tensor], None], thread: int) -> Callable:
    """Forward hook handing a scored layer's projection output to the prefill (``keep``)."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if _serves(thread):
            keep(output)

    return hook


def _rescale(prefill: Prefill, attention: nn.Module, thread: int) -> Callable:
    """Forward hook on the query projection of a layer after a stage that scales its queries by their
    places in the sequence: the places of the kept tokens in the prompt (``Prefill.rescale_queries``)."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not _serves(thread):
            return None
        return prefill.rescale_queries(attention, output)

    return hook


def _places_in_prompt(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Permanent pre-hook of an attention that scales its queries by their places in the sequence, read
    from its cache's length: on a pruned cache (decode steps, later turns) that length counts the prompt's
    pruned tokens too, so the places are the unpruned conversation's. Host work only (no sync)."""

    def view(cache: Any) -> Any:
        ledger = ledger_of(cache)
        return cache if ledger is None else compat.cache.ShiftedLength(cache, ledger.dropped)

    return args, compat.cache.with_cache(kwargs, view)


def _capture_input(prefill: Prefill, thread: int, contract: compat.calls.LayerContract) -> Callable:
    """Forward pre-hook keeping the hidden states that enter the first decoder layer (the language
    model's input embeddings), before any stage runs."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if _serves(thread):
            prefill.keep_embeddings(contract.call(args, kwargs).hidden)

    return hook
