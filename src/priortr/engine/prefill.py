"""One pruned prefill: the stages of a plan, run between decoder layers.

Before decoder layer ``l``, a stage scored at layer ``l - 1`` (or, for ``l = 0``, before the language
model) runs: gather evidence -> select -> cut. Layers after the first cut receive RoPE and masks
gathered to the kept tokens; the layer a stage scores hands over its RoPE, its cache and (through the
projection hooks) its queries and keys.
"""

from __future__ import annotations

from typing import Any

import torch

from priortr import compat
from priortr.adapters import FamilyAdapter
from priortr.adapters.base import VisionProbe
from priortr.checks import value_checks_enabled
from priortr.engine.config import BEFORE_LLM, PruningConfig
from priortr.engine.cut import Decision, cut
from priortr.engine.evidence import (
    attention_at_layer,
    groups,
    input_embeddings,
    next_layer_attention,
    stage_inputs,
    token_evidence,
    vision_evidence,
)
from priortr.engine.ledger import CacheLedger, write_ledger
from priortr.engine.plan import PrefillPlan
from priortr.engine.report import LayerCache, PrefillRecord, Scored
from priortr.engine.sequence import SequenceMap


class Prefill:
    """The state of one prefill forward pass, from the model's pre-hook to its last stage."""

    def __init__(
        self,
        plan: PrefillPlan,
        config: PruningConfig,
        adapter: FamilyAdapter,
        vision: tuple[VisionProbe, dict[str, torch.Tensor]] | None,
        explicit_mask: compat.masks.ExplicitMask,
        final_norm: torch.nn.Module | None = None,
        attention_layers: frozenset[int] | None = None,
        windows: list[compat.layers.Window | None] | None = None,
    ) -> None:
        self.plan = plan
        self.config = config
        self.adapter = adapter
        self.vision = vision
        self.explicit_mask = explicit_mask
        self.attention_layers = attention_layers
        self.windows = windows
        self.final_norm = final_norm
        self.sequence = SequenceMap(
            prompt_length=plan.seq,
            positions=None,
            visual=plan.visual,
            valid=plan.valid,
            filler=None,
        )
        self.pending = list(plan.stages)
        self.captured: dict[str, Any] = {}
        self.cache: Any = None
        self.record = PrefillRecord(visual=plan.visual, stages=[], scored=[])
        self.input_positions: list[torch.Tensor] | None = None
        if "input_embeddings" in config.method.needs:  # pools narrow stage by stage; keep their start
            self.input_positions = [pool.positions for pool in plan.pools]
        self._layer_inputs: dict[tuple[int, int], tuple[Any, ...]] = {}

    @property
    def next_stage(self) -> int | None:
        """The scored layer of the next stage (-1: before the language model), None when all ran."""
        return self.pending[0] if self.pending else None

    def before_layer(self, index: int, layer: torch.nn.Module, call: compat.calls.LayerCall) -> None:
        """Run what has to happen before decoder layer ``index``; rewrites its ``call`` in place."""
        if self.next_stage == index - 1:
            if self.next_stage == BEFORE_LLM:
                self.cache = call.cache
            call.hidden = self.run_stage(call.hidden, layer, call.rope)
        if self.sequence.positions is not None:
            self._gather_layer_inputs(call, index)
        if self.next_stage == index:
            cache = call.cache
            if cache is not None:
                local = None if self.windows is None else [window is not None for window in self.windows]
                compat.cache.check_prunable(cache, index, local)
            self.cache = cache
            self.captured["rope"] = call.rope
            self.captured["attention"] = self.adapter.attention(layer)

    @torch.no_grad()
    def run_stage(
        self, hidden: torch.Tensor, next_layer: torch.nn.Module, rope: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """Gather evidence -> select -> cut, for every group of pools this stage ranks, before
        ``next_layer`` runs on ``hidden`` with the prompt's RoPE ``rope`` (not yet gathered)."""
        layer = self.pending.pop(0)
        plan, config, method = self.plan, self.config, self.config.method
        with value_checks_enabled(config.strict):
            attention = None
            if "attention" in method.needs:
                attention = attention_at_layer(
                    plan, self.sequence, self.captured, self.adapter, self._window(layer)
                )
            elif "next_attention" in method.needs:
                if self.sequence.positions is not None:
                    rope = self.adapter.gather_rope(rope, self.sequence.positions)
                attention = next_layer_attention(
                    plan, self.sequence, hidden, next_layer, rope, self.adapter, self._window(layer + 1)
                )
            decisions = []
            for group in groups(plan, self.sequence, layer, self.input_positions is not None):
                vision, project = None, None
                if self.vision is not None:
                    probe, capture = self.vision
                    vision, project = vision_evidence(capture, probe, plan, group, method), probe.projector
                tokens = embeddings = None
                if method.needs & {"keys", "final_norm"}:
                    tokens = token_evidence(
                        group,
                        hidden,
                        plan,
                        self.sequence,
                        self.captured,
                        self.adapter,
                        self.final_norm,
                        method.needs,
                    )
                if self.input_positions is not None:
                    embeddings = input_embeddings(
                        self.captured.get("embeddings"), self.input_positions, plan, group
                    )
                inputs = stage_inputs(group, hidden, attention, plan, config, vision, tokens, embeddings)
                selection = method.select(inputs, **config.options)
                if selection.kept.shape[0] != len(group.pools) or selection.kept.shape[1] > group.size:
                    raise ValueError(
                        f"method {method.name!r} kept {tuple(selection.kept.shape)} visual tokens for "
                        f"{len(group.pools)} images of {group.size} tokens"
                    )
                if not self.record.stages and selection.scores is not None and inputs.attention is not None:
                    pools = [(pool.row, pool.positions) for pool in group.pools]
                    self.record.scored.append(Scored(pools, inputs.attention, selection.scores))
                decisions.append(Decision(group, selection, inputs.hidden, inputs.vision_features, project))
            changed = any(
                d.selection.kept.shape[1] < d.group.size or d.selection.merge is not None for d in decisions
            )
            if changed:
                unranked = [pool for pool in plan.pools if layer not in pool.stages]
                hidden = cut(
                    self.sequence, plan.text_tokens, decisions, unranked, hidden, self.cache, layer + 1
                )
                self._layer_inputs.clear()
        stage = [(pool.row, pool.positions) for pool in plan.pools]
        self.record.stages.append((layer, stage, any(d.selection.merge is not None for d in decisions)))
        if not self.pending:
            self.finish()
        return hidden

    def finish(self) -> None:
        """Close the record and, when the cache was pruned, write its ledger."""
        sequence = self.sequence
        self.record.sequence = sequence
        self.record.pruned = sequence.positions is not None
        self.record.cache = tuple(
            LayerCache.of(self._kind(index), self._window(index), self.plan.seq, sequence.width)
            for index in range(len(self.windows or ()))
        )
        if self.record.pruned and self.cache is not None:
            ledger = CacheLedger(
                prompt_length=self.plan.seq,
                kept_length=sequence.width,
                prompt_mask=sequence.key_valid().long(),
                filler=sequence.filler,
                next_position=self.plan.next_position,
                kept_positions=self.plan.text_positions.gather(1, sequence.positions),
                masked=self.plan.padded or sequence.filler is not None,
            )
            write_ledger(self.cache, ledger)

    def _window(self, layer: int) -> compat.layers.Window | None:
        return None if self.windows is None else self.windows[layer]

    def _kind(self, layer: int) -> str:
        """``keys`` (per token), ``window`` (a local window's tail) or ``state`` (fixed size)."""
        if self.attention_layers is not None and layer not in self.attention_layers:
            return "state"
        return "keys" if self._window(layer) is None else "window"

    def _gather_layer_inputs(self, call: compat.calls.LayerCall, index: int) -> None:
        """RoPE and mask of layer ``index`` once it runs on the kept tokens only, computed once per stage
        and kind of layer (a layer without softmax attention takes a padding mask)."""
        rope, mask = call.rope, call.mask
        attention = self.attention_layers is None or index in self.attention_layers
        positions, filler = self.sequence.positions, self.sequence.filler
        keys = compat.cache.key_length(call.cache, index, positions.shape[1]) if attention else 0
        key = (id(rope), id(mask), attention, keys)
        if key not in self._layer_inputs:
            gathered_rope = self.adapter.gather_rope(rope, positions)
            explicit = self.explicit_mask if attention else compat.masks.padding_mask
            gathered_mask = compat.masks.for_kept_layer(
                mask, positions, self.plan.seq, keys, filler, explicit, rope[0].dtype
            )
            self._layer_inputs[key] = (rope, mask, gathered_rope, gathered_mask)  # originals keep ids unique
        _, _, call.rope, call.mask = self._layer_inputs[key]
        call.clear_positions()
