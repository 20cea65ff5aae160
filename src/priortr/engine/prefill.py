"""One pruned prefill: the stages of a plan, run between decoder layers.

A stage is named by the layer it scores, ``s`` (-1: before the language model), and runs before layer
``s + 1``: gather evidence -> select -> cut -> record (``run_stage``). Layer ``s`` hands it a
``ScoredLayer`` (its attention module, RoPE and, through the projection hooks, its queries and keys).
Layers after the first cut receive RoPE and masks gathered to the kept tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from priortr import compat
from priortr.adapters import FamilyAdapter
from priortr.adapters.base import VisionProbe
from priortr.engine.config import BEFORE_LLM, PruningConfig
from priortr.engine.cut import Decision, cut
from priortr.engine.evidence import Group, ScoredLayer, Sources, gather, groups
from priortr.engine.ledger import CacheLedger, ledger_for
from priortr.engine.plan import PrefillPlan
from priortr.engine.result import LayerCache, PrefillRecord
from priortr.engine.sequence import SequenceMap
from priortr.methods.selection import StageInputs
from priortr.methods.value_checks import value_checks_enabled


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
        self.scored: ScoredLayer | None = None  # what the next stage's scored layer handed over
        self.embeddings: torch.Tensor | None = None  # [B, S, D] the input of decoder layer 0
        self.cache: Any = None
        self.ledger: CacheLedger | None = None  # written to the cache when the model returns
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
        """Run what has to happen before decoder layer ``index``; rewrites its ``call`` in place: the stage
        scored at ``index - 1``, the kept tokens' RoPE and mask, and the capture of layer ``index`` when
        the next stage scores it."""
        if self.next_stage == BEFORE_LLM:
            self.cache = call.cache
        if self.next_stage is not None and self.next_stage + 1 == index:
            call.hidden = self.run_stage(call.hidden, layer, call.rope)
        if self.sequence.positions is not None:
            self._gather_layer_inputs(call, index)
        if self.next_stage == index:
            self._capture(index, layer, call)

    def keep_queries(self, output: torch.Tensor) -> None:
        """The scored layer's query projection output [B, S', H * d], as it ran."""
        self.scored.query_out = output

    def keep_keys(self, output: torch.Tensor) -> None:
        """The scored layer's key projection output [B, S', Hkv * d], as it ran."""
        self.scored.key_out = output

    def keep_embeddings(self, hidden: torch.Tensor) -> None:
        """The hidden states [B, S, D] entering decoder layer 0, before any stage."""
        self.embeddings = hidden

    @torch.no_grad()
    def run_stage(
        self, hidden: torch.Tensor, next_layer: torch.nn.Module, rope: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """The next stage, before ``next_layer`` runs on ``hidden`` [B, S', D] with the prompt's RoPE
        ``rope`` (not yet gathered): gather evidence -> select -> cut -> record."""
        layer = self.pending.pop(0)
        decisions = []
        with value_checks_enabled(self.config.strict):
            sources = self._sources(layer, hidden, next_layer, rope)
            for group in groups(self.plan, self.sequence, layer, self.input_positions is not None):
                inputs = gather(self.config.method.needs, sources, group)
                decisions.append(self._select(group, inputs))
            if any(decision.changes for decision in decisions):
                hidden = self._cut(layer, decisions, hidden)
        merged = any(decision.selection.merge is not None for decision in decisions)
        self.record.add_stage(layer, self.plan.pools, merged)
        if not self.pending:
            self.finish()
        return hidden

    def finish(self) -> None:
        """Close the record and, when the cache was pruned, make its ledger."""
        sequence = self.sequence
        self.record.sequence = sequence
        self.record.pruned = sequence.positions is not None
        self.record.cache = tuple(
            LayerCache.of(self._kind(index), self._window(index), self.plan.seq, sequence.width)
            for index in range(len(self.windows or ()))
        )
        if self.record.pruned and self.cache is not None:
            self.ledger = ledger_for(self.plan, sequence)

    def _capture(self, index: int, layer: torch.nn.Module, call: compat.calls.LayerCall) -> None:
        """Start the capture of layer ``index``, which the next stage scores; its cache must be prunable."""
        cache = call.cache
        if cache is not None:
            local = None if self.windows is None else [window is not None for window in self.windows]
            compat.cache.check_prunable(cache, index, local)
        self.cache = cache
        self.scored = ScoredLayer(index, self.adapter.attention(layer), call.rope)

    def _sources(
        self, layer: int, hidden: torch.Tensor, next_layer: torch.nn.Module, rope: tuple[torch.Tensor, ...]
    ) -> Sources:
        """Where the stage scored at ``layer`` reads its evidence."""
        return Sources(
            plan=self.plan,
            sequence=self.sequence,
            config=self.config,
            hidden=hidden,
            adapter=self.adapter,
            scored=self.scored if layer != BEFORE_LLM else None,
            next_layer=next_layer,
            rope=rope,
            window=self._window(layer) if layer != BEFORE_LLM else None,
            next_window=self._window(layer + 1),
            vision=self.vision,
            final_norm=self.final_norm,
            embeddings=self.embeddings,
            input_positions=self.input_positions,
        )

    def _select(self, group: Group, inputs: StageInputs) -> Decision:
        """The method's selection for ``group``, checked against the group's size."""
        method = self.config.method
        selection = method.select(inputs, **self.config.options)
        if selection.kept.shape[0] != len(group.pools) or selection.kept.shape[1] > group.size:
            raise ValueError(
                f"method {method.name!r} kept {tuple(selection.kept.shape)} visual tokens for "
                f"{len(group.pools)} images of {group.size} tokens"
            )
        self.record.note_scores(group.pools, inputs.attention, selection.scores)
        project = self.vision[0].projector if self.vision is not None else None
        return Decision(group, selection, inputs.hidden, inputs.vision_features, project)

    def _cut(self, layer: int, decisions: list[Decision], hidden: torch.Tensor) -> torch.Tensor:
        """Apply the stage's ``decisions`` to ``hidden``, the sequence map and the cache of layers
        ``0 .. layer``; the pools this stage does not rank keep every token."""
        unranked = [pool for pool in self.plan.pools if layer not in pool.stages]
        sequence, text_tokens = self.sequence, self.plan.text_tokens
        hidden = cut(sequence, text_tokens, decisions, unranked, hidden, self.cache, layer + 1)
        self._layer_inputs.clear()
        return hidden

    def rescale_queries(self, attention: torch.nn.Module, queries: torch.Tensor) -> torch.Tensor | None:
        """The query projection's output [B, S', H * d] of a layer that scales its queries by each one's
        place in the sequence it runs on (``adapter.scales_queries``), rescaled so that the layer's own
        factor for kept token i (its place among the kept tokens) becomes the factor of its place in the
        prompt, as in the unpruned model; None (unchanged) before the first cut and for the engine's own
        projection of a few rows (PyramidDrop's next-layer evidence, placed by ``evidence``)."""
        positions = self.sequence.positions
        if positions is None or queries.shape[1] != positions.shape[1]:
            return None
        counted = torch.arange(positions.shape[1], device=positions.device)[None]
        scales = self.adapter.query_scales
        ratio = scales(attention, positions) / scales(attention, counted)
        return (queries * ratio.to(queries.device)).to(queries.dtype)

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
                mask, positions, self.plan.seq, keys, filler, explicit, call.hidden.dtype
            )
            self._layer_inputs[key] = (rope, mask, gathered_rope, gathered_mask)  # originals keep ids unique
        _, _, call.rope, call.mask = self._layer_inputs[key]
        call.clear_positions()
