"""One pruned prefill: the stages of a plan, run between decoder layers.

A stage is named by the layer it scores, ``s`` (-1: before the language model), and runs before layer
``s + 1``: one call of the shared stage core (``priortr.engine.stage.run_stage``: gather evidence ->
select -> cut), then the record (``run_next_stage``). Layer ``s`` hands it a ``ScoredLayer`` (its
attention module, RoPE and, through the projection hooks, its queries and keys). Layers after the first
cut receive RoPE and masks gathered to the kept tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from priortr import compat
from priortr.adapters import FamilyAdapter
from priortr.adapters.base import VisionProbe
from priortr.engine.config import BEFORE_LLM, PruningConfig
from priortr.engine.evidence import ScoredLayer, Sources
from priortr.engine.ledger import CacheLedger, ledger_for
from priortr.engine.plan import PrefillPlan
from priortr.engine.result import LayerCache, PrefillRecord
from priortr.engine.sequence import SequenceMap
from priortr.engine.stage import run_stage
from priortr.engine.state import StageState

StageObserver = Callable[[str, int], None]
"""Called as ``observer("start", layer)`` before and ``observer("end", layer)`` after all of the engine's
work between decoder layers ``layer`` and ``layer + 1`` for the stage scored at ``layer``: evidence,
decision, cut, cache compaction, the record, and the kept tokens' RoPE and mask for the next layer. On the
host, in the thread running the model: timing marks (``priortr bench``) or profiling ranges."""


class Prefill:
    """One prefill forward pass, from the model's pre-hook to its last stage: its plan, the state its
    stages have left (``state``, replaced by each stage) and its record."""

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
        observers: Sequence[StageObserver] = (),
        kv_shared: dict[int, str] | None = None,
    ) -> None:
        self.plan = plan
        self.config = config
        self.adapter = adapter
        self.vision = vision
        self.explicit_mask = explicit_mask
        self.attention_layers = attention_layers
        self.windows = windows
        self.final_norm = final_norm
        self.observers = tuple(observers)
        self.kv_shared = kv_shared or {}  # layer -> the shared keys it reads (KV sharing)
        self.state = StageState.of_prompt(plan)
        self.pending = list(plan.stages)
        self.scored: ScoredLayer | None = None  # what the next stage's scored layer handed over
        self.embeddings: torch.Tensor | None = None  # [B, S, D] the input of decoder layer 0
        self.cache: Any = None
        self.ledger: CacheLedger | None = None  # written to the cache when the model returns
        self.record = PrefillRecord(visual=plan.visual, stages=[], scored=[])
        self._layer_inputs: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    @property
    def reads_embeddings(self) -> bool:
        """Whether a stage reads the hidden states entering decoder layer 0 (``keep_embeddings``)."""
        return "input_embeddings" in self.config.method.needs

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
        stage = self.next_stage if self.next_stage is not None and self.next_stage + 1 == index else None
        if stage is not None:
            self._observe("start", stage)
            before = self.state.sequence
            call.set_hidden(self.run_next_stage(call.hidden, layer, call.rope))
            self._cut_shared(call, before)
        if self.state.sequence.positions is not None:
            self._gather_layer_inputs(call, index)
        if stage is not None:
            self._observe("end", stage)
        if self.next_stage == index:
            self._capture(index, layer, call)

    def _cut_shared(self, call: compat.calls.LayerCall, before: SequenceMap) -> None:
        """Cut the keys and values that layers up to the stage's stored for later ones (KV sharing) as the
        stage cut the sequence ``before`` it: they hold its columns, as the caches of those layers did."""
        after = self.state.sequence
        if after is before or not call.shared_states:
            return
        index = before.columns_of_rows(after.positions)  # [B, S''] columns of ``before`` kept
        compat.cache.cut_shared(call.shared_states, index, before.width)

    def _observe(self, event: str, stage: int) -> None:
        for observe in self.observers:
            observe(event, stage)

    def keep_queries(self, output: torch.Tensor) -> None:
        """The scored layer's query projection output [B, S', H * d], as it ran."""
        self.scored.query_out = output

    def keep_keys(self, output: torch.Tensor) -> None:
        """The scored layer's key projection output [B, S', Hkv * d], as it ran."""
        self.scored.key_out = output

    def keep_embeddings(self, hidden: torch.Tensor) -> None:
        """The hidden states [B, S, D] entering decoder layer 0, before any stage."""
        self.embeddings = hidden

    def run_next_stage(
        self, hidden: torch.Tensor, next_layer: torch.nn.Module, rope: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """The next stage, before ``next_layer`` runs on ``hidden`` [B, S', D] with the prompt's RoPE
        ``rope`` (not yet gathered): the stage core, then the record."""
        layer = self.pending.pop(0)
        project = self.vision[0].projector if self.vision is not None else None
        sources = self._sources(layer, hidden, next_layer, rope)
        outcome = run_stage(layer, sources, hidden, self.cache, project)
        for decision in outcome.decisions:
            self.record.note_scores(decision.group.pools, decision.evidence, decision.selection.scores)
        self.record.add_stage(layer, outcome.state.pools, outcome.merged)
        if outcome.state is not self.state:
            self._layer_inputs.clear()
            self.state = outcome.state
        if not self.pending:
            self.finish()
        return outcome.hidden

    def finish(self) -> None:
        """Close the record and, when the cache was pruned, make its ledger."""
        sequence = self.state.sequence
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
            state=self.state,
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
        )

    def rescale_queries(self, attention: torch.nn.Module, queries: torch.Tensor) -> torch.Tensor | None:
        """The query projection's output [B, S', H * d] of a layer that scales its queries by each one's
        place in the sequence it runs on (``adapter.scales_queries``), rescaled so that the layer's own
        factor for kept token i (its place among the kept tokens) becomes the factor of its place in the
        prompt, as in the unpruned model; None (unchanged) before the first cut and for the engine's own
        projection of a few rows (PyramidDrop's next-layer evidence, placed by ``evidence``)."""
        positions = self.state.sequence.positions
        if positions is None or queries.shape[1] != positions.shape[1]:
            return None
        counted = torch.arange(positions.shape[1], device=positions.device)[None]
        scales = self.adapter.query_scales
        ratio = scales(attention, positions) / scales(attention, counted)
        return (queries * ratio.to(queries.device)).to(queries.dtype)

    def _window(self, layer: int) -> compat.layers.Window | None:
        return None if self.windows is None else self.windows[layer]

    def _kind(self, layer: int) -> str:
        """``keys`` (per token), ``window`` (a local window's tail), ``state`` (fixed size) or ``shared``
        (none: it reads an earlier layer's keys)."""
        if self.attention_layers is not None and layer not in self.attention_layers:
            return "state"
        if layer in self.kv_shared:
            return "shared"
        return "keys" if self._window(layer) is None else "window"

    def _gather_layer_inputs(self, call: compat.calls.LayerCall, index: int) -> None:
        """RoPE and mask of layer ``index`` once it runs on the kept tokens only, computed once per stage
        and kind of layer (a layer without softmax attention takes a padding mask).

        The kind is what the config declares (its window, whether it attends, its key length), known on
        the host, so the cache traces under ``torch.compile`` on every supported torch (torch 2.11's
        dynamo cannot take ``id()`` of a tensor made in the graph). That the layers of one kind share
        their RoPE and mask objects, as transformers passes them, is checked on every eager prefill."""
        rope, mask = call.rope, call.mask
        attention = self.attention_layers is None or index in self.attention_layers
        positions, filler = self.state.sequence.positions, self.state.sequence.filler
        if index in self.kv_shared:  # it attends over the keys an earlier layer stored: as many as those
            keys = call.shared_key_length(self.kv_shared[index])
        else:
            keys = compat.cache.key_length(call.cache, index, positions.shape[1]) if attention else 0
        key = (self._window(index), attention, keys)
        cached = self._layer_inputs.get(key)
        if cached is None:
            gathered_rope = self.adapter.gather_rope(rope, positions)
            explicit = self.explicit_mask if attention else compat.masks.padding_mask
            gathered_mask = compat.masks.for_kept_layer(
                mask, positions, self.plan.seq, keys, filler, explicit, call.hidden.dtype
            )
            cached = self._layer_inputs[key] = (rope, mask, gathered_rope, gathered_mask)
        elif not torch.compiler.is_compiling():
            _check_shared_inputs(cached[0], cached[1], rope, mask, index)
        call.set_rope(cached[2])
        call.set_mask(cached[3])
        call.gather_token_inputs(positions)
        call.clear_positions()


def _check_shared_inputs(rope: Any, mask: Any, layer_rope: Any, layer_mask: Any, index: int) -> None:
    """Refuse a model whose layers of one kind receive different RoPE or masks: the per-kind cache of
    ``Prefill._gather_layer_inputs`` would hand layer ``index`` another layer's. RoPE is a tuple of
    tensors (``(cos, sin)``) or one tensor (Llama 4's ``freqs_cis``); the tuple itself may be rebuilt, and
    a tensor may come as a view of all of it (Gemma 4 slices its KV-shared layers' inputs to the rows it
    keeps, all of them in a pruned prefill)."""
    if isinstance(rope, tuple) and isinstance(layer_rope, tuple):
        parts = zip(rope, layer_rope, strict=False)
        same_rope = len(rope) == len(layer_rope) and all(_same(a, b) for a, b in parts)
    else:
        same_rope = _same(rope, layer_rope)
    if not (same_rope and _same(mask, layer_mask)):
        raise NotImplementedError(
            f"decoder layer {index} received a RoPE or mask other than the earlier layers of its kind "
            "(window, attention, key length); priortr gathers them once per kind. Report the model."
        )


def _same(tensor: Any, other: Any) -> bool:
    """Whether ``other`` is ``tensor`` or a view of all of it (host metadata only)."""
    if tensor is other:
        return True
    if not (isinstance(tensor, torch.Tensor) and isinstance(other, torch.Tensor)):
        return False
    return (
        tensor.data_ptr() == other.data_ptr()
        and tensor.shape == other.shape
        and tensor.stride() == other.stride()
        and tensor.dtype == other.dtype
    )
