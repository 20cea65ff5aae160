"""The hook wiring: how a prefill and the calls after it reach the engine's parts.

One permanent pre-hook on the multimodal model sees every call. A call that continues a pruned cache
(a decode step, a later chat turn) is adjusted by the cache's ledger (``ledger.continue_call``) and
nothing else runs. A prefill that brings images is planned on the host (``plan.make_plan``); only then
are hooks armed, on the decoder layers a stage needs and the projections of the layers it scores, and
they are disarmed as soon as the model returns. Decode steps therefore run no per-layer hook at all.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from priortr import compat
from priortr.adapters import FamilyAdapter
from priortr.adapters.base import VisionProbe
from priortr.engine.config import BEFORE_LLM, PruningConfig
from priortr.engine.evidence import VISION_NEEDS
from priortr.engine.ledger import continue_call, ledger_of, write_ledger
from priortr.engine.plan import make_plan, skip_prefill
from priortr.engine.prefill import Prefill
from priortr.engine.report import PrefillRecord, PruneResult


class PruningEngine:
    """Hooks physical visual-token pruning into one model; ``detach()`` restores it exactly."""

    def __init__(self, model: nn.Module, adapter: FamilyAdapter, config: PruningConfig) -> None:
        self.model = model
        self.adapter = adapter
        self.config = config
        self.multimodal = adapter.multimodal_model(model)
        self.layers = adapter.decoder_layers(model)
        self.vision = adapter.vision_probe(model) if config.method.needs & VISION_NEEDS else None
        self._parameters = tuple(inspect.signature(self.multimodal.forward).parameters)
        text_config = model.config.get_text_config()
        self._attention_implementation = getattr(text_config, "_attn_implementation", None) or "sdpa"
        self._vision_capture: dict[str, torch.Tensor] = {}
        self._record: PrefillRecord | None = None
        self._last: PruneResult | None = None
        self._permanent: list[RemovableHandle] = []
        self._armed: list[RemovableHandle] = []

    @property
    def last(self) -> PruneResult | None:
        """What the most recent pruned prefill kept (``PruneResult``), built when first read."""
        if self._record is not None:
            self._last, self._record = self._record.result(), None
        return self._last

    def attach(self) -> None:
        self._permanent = [self.multimodal.register_forward_pre_hook(self._on_model_call, with_kwargs=True)]
        if self.vision is not None:
            self._permanent += vision_hooks(self.vision, self.config.method.needs, self._vision_capture)

    def detach(self) -> None:
        self._disarm()
        for handle in self._permanent:
            handle.remove()
        self._permanent = []
        self._vision_capture.clear()

    def _on_model_call(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._armed:
            self._disarm()  # a prefill that raised left its hooks armed
        call = dict(zip(self._parameters, args, strict=False))
        call.update(kwargs)
        cache = call.get("past_key_values")
        ledger, new = ledger_of(cache), _new_tokens(call)
        decode_step = new == 1 and (ledger is not None or not compat.has_visual_inputs(call))
        if decode_step and ledger is None:
            return None  # a decode step on a cache that was not pruned
        # A decode step reads nothing back; a longer call reads a static cache's length (a prefill or turn).
        empty = not decode_step and (cache is None or compat.cache_length(cache) == 0)
        if ledger is not None:
            if not empty:  # a decode step or a later chat turn
                continue_call(ledger, call, cache, self.adapter, self.model, self.config.strict)
                return (), call
            write_ledger(cache, None)  # the cache was reset for a new prompt
        if not compat.has_visual_inputs(call):
            if empty:
                skip_prefill(
                    self.config, "the call brings no images, so the prompt has no image tokens to prune"
                )
            return None
        if not empty:
            return None  # images on a cache this engine did not prune: no prefill to plan
        if compat.has_raw_pixels(call):
            self._vision_capture.clear()  # the tower runs inside this call; generate() runs it before
        plan = make_plan(self.adapter, self.model, self.config, call, len(self.layers))
        if plan is None:
            return None
        vision = None if self.vision is None else (self.vision, self._vision_capture)
        norm = self.adapter.final_norm(self.model) if "final_norm" in self.config.method.needs else None
        prefill = Prefill(plan, self.config, self.adapter, vision, self._attention_implementation, norm)
        self._last = None
        self._record = prefill.record
        if plan.stages:
            self._arm(prefill)
        else:
            prefill.finish()
        return (), call

    def _arm(self, prefill: Prefill) -> None:
        """Hooks for this prefill only: a pre-hook on every layer from the first stage on, the q/k
        projections of each scored layer (attention methods), and the first layer's input (methods
        that read the input embeddings)."""
        stages = prefill.plan.stages
        if prefill.input_positions is not None:
            self._armed.append(
                self.layers[0].register_forward_pre_hook(_capture_input(prefill), with_kwargs=True)
            )
        for index in range(max(stages[0], 0), len(self.layers)):
            hook = self._before_layer(prefill, index)
            self._armed.append(self.layers[index].register_forward_pre_hook(hook, with_kwargs=True))
        if self.config.method.needs & {"attention", "keys"}:
            for index in (layer for layer in stages if layer != BEFORE_LLM):
                attention = self.adapter.attention(self.layers[index])
                self._armed += [
                    self.adapter.query_projection(attention).register_forward_hook(_capture(prefill, "q")),
                    self.adapter.key_projection(attention).register_forward_hook(_capture(prefill, "k")),
                ]
        self._armed.append(self.multimodal.register_forward_hook(self._on_model_return, always_call=True))

    def _disarm(self) -> None:
        for handle in self._armed:
            handle.remove()
        self._armed = []

    def _on_model_return(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._disarm()
        self._vision_capture.clear()

    @staticmethod
    def _before_layer(prefill: Prefill, index: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return prefill.before_layer(index, module, args, kwargs)

        return hook


def vision_hooks(probe: VisionProbe, needs: frozenset[str], capture: dict[str, torch.Tensor]) -> list:
    """Permanent hooks keeping, each time the vision tower runs, the tensors ``needs`` asks for:
    the feature layer's q/k (``vision``), the last layer's q/k (``vision_last``) and the projector's
    input (``features``). They only keep references; the stage reads them once per prefill."""

    def output_of(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            capture[name] = output

        return hook

    def input_of(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            capture[name] = args[0]

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


def _capture(prefill: Prefill, name: str) -> Callable:
    """Forward hook keeping a scored layer's projection output for the stage."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        prefill.captured[name] = output

    return hook


def _capture_input(prefill: Prefill) -> Callable:
    """Forward pre-hook keeping the hidden states that enter the first decoder layer (the language
    model's input embeddings), before any stage runs."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        prefill.captured["embeddings"] = args[0] if args else kwargs["hidden_states"]

    return hook


def _new_tokens(call: dict) -> int:
    """How many new tokens a call brings (input ids or embeddings)."""
    inputs = call.get("input_ids")
    inputs = call.get("inputs_embeds") if inputs is None else inputs
    return 0 if inputs is None else inputs.shape[1]
