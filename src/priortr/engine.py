"""The pruning engine: the only code that touches hidden states, masks, positions and the KV cache.

It attaches PyTorch module hooks to a stock transformers model (no copied modeling code) and, during
the prefill of a prompt with an image:

1. finds every image and video of every row (``adapter.visual_items``; each item's separator is the
   slot right after it, Appendix A.3), groups them into pools ranked together (``priortr.pools``) and
   plans the method's stages: before the language model, after one decoder layer, or after several
   (``priortr.methods``);
2. at each stage, before the next layer runs, gathers the evidence the method asks for: attention
   rows recomputed from the scored layer's own query/key projections (``probe.attention_rows``), the
   visual tokens' hidden states, the vision tower's [CLS] attention, and calls the method's selector
   once per group of equally sized pools;
3. keeps the selected visual tokens (merging hidden states where the selector says so): the hidden
   states, the KV cache of layers 0..L are gathered, and later layers receive gathered RoPE (cos, sin)
   and masks, so kept tokens keep their original positions (paper Algorithm 1, Phase 3). Rows left
   with fewer tokens than others keep some pruned tokens as padding, masked from every query;
4. remembers, per cache object, which prompt columns were dropped or masked, so that decode steps
   and later chat turns on the same cache get masks and positions that match the shorter cache.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from priortr import compat
from priortr.adapters import FamilyAdapter
from priortr.evidence import PoolAttention, pool_attention
from priortr.methods import MethodInfo
from priortr.pools import Pool, make_pools, split_count
from priortr.probe import RowSpec, apply_rope, attention_rows, cls_attention
from priortr.scoring import aggregate_heads, build_evidence, resolve_budget
from priortr.selection import Selection, StageInputs
from priortr.surgery import compact_cache_layer, drop_columns, gather_sequence

POSTERIOR_ROWS = ("after_separator", "from_separator", "last")
HEAD_AGGREGATIONS = ("mean", "max")
BEFORE_LLM = -1
"""The stage layer of methods that prune the language model's input embeddings (``where='vision'``)."""
DEFAULT_LAYER = 2
"""The decoder layer one-layer methods score unless told otherwise (the paper scores early, Sec. 4)."""


class PruningSkippedWarning(UserWarning):
    """A forward pass ran unpruned because its prompt has nothing to prune."""


@dataclass(frozen=True)
class PruningConfig:
    """What to prune and how; validated by ``priortr.apply``.

    ``layer`` is the 0-indexed decoder layer whose attention is scored by a one-layer method; layers
    ``layer+1 ..`` run on the kept tokens (the authors' code calls this "prune layer layer+1").
    ``stages`` replaces the method's schedule by explicit (scored layer, budget) pairs, the budgets
    counting or taking a ratio of the image's visual tokens. ``options`` are the selector's knobs.
    ``posterior_rows`` chooses the rows averaged into P: every prompt token after the separator
    (default), the separator too (as the authors' code does), or the last prompt token only.
    ``separator_offset`` moves the prior's slot that many tokens after the first post-image token
    (the paper's null-token ablation). ``multi_image`` says how the items of a row share the budget
    (``priortr.pools``).
    """

    method: MethodInfo
    budget: int | float
    layer: int
    stages: tuple[tuple[int, int | float], ...] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    heads: str = "mean"
    posterior_rows: str = "after_separator"
    separator_offset: int = 0
    multi_image: str = "per_image"
    strict: bool = False
    seed: int = 0

    def plan(
        self, n_visual: int, n_layers: int, part: tuple[int, int] | None = None
    ) -> list[tuple[int, int]]:
        """The (layer, tokens kept after it) stages for a pool of ``n_visual`` tokens.

        ``part`` = (the row's visual tokens before this pool, all of them) splits a count budget over
        the pools of a row in proportion to their sizes (``pools.split_count``); ratios need no split.
        """

        def count(budget: int | float) -> int:
            if part is not None and isinstance(budget, int):
                budget = split_count(budget, part[0], n_visual, part[1])
            return resolve_budget(budget, n_visual)

        if self.stages is not None:
            return [(layer, count(budget)) for layer, budget in self.stages]
        kept = count(self.budget)
        if self.method.schedule is not None:
            return self.method.schedule(kept, n_visual, self.layer, n_layers)
        return [(BEFORE_LLM if self.method.where == "vision" else self.layer, kept)]


@dataclass(frozen=True)
class StageResult:
    """One stage of a pruned prefill: the scored layer (-1: before the LLM) and what survived it.

    ``kept`` [B, K] holds the absolute prompt positions of every row's surviving visual tokens,
    ascending, padded with -1 where rows kept fewer; ``merged`` says whether survivors carry merged
    hidden states.
    """

    layer: int
    kept: torch.Tensor
    merged: bool

    def kept_mask(self, seq: int) -> torch.Tensor:
        """[B, seq] True at the surviving visual tokens' positions."""
        mask = torch.zeros(self.kept.shape[0], seq + 1, dtype=torch.bool, device=self.kept.device)
        mask.scatter_(1, self.kept.where(self.kept >= 0, seq), True)
        return mask[:, :seq]


@dataclass(frozen=True)
class PruneResult:
    """What one pruned prefill kept, and why (``handle.last``).

    Attributes:
        kept: [B, K] absolute prompt positions of the visual tokens left after the last stage,
            ascending, padded with -1 where a row kept fewer (ragged batches).
        n_visual: [B] visual tokens of each row before pruning (all its images and videos).
        prior, posterior, scores: [B, N] float32 Q, P and the rule's scores over each row's visual
            tokens in prompt order at the first stage (NaN past a row's own count), for methods that
            rank by a scoring rule; None otherwise. With several images per row each image's Q and P
            are normalised over its own tokens (``multi_image='per_image'``).
        visual_start: [B] absolute position of each row's first visual token.
        positions: [B, S'] original prompt position of every token left after the last stage, i.e. of
            each row of the logits that a plain forward returns.
        padding: [B, S'] True at pruned tokens kept only so that rows have one length (ragged
            batches); they are masked from every query and their logits are meaningless.
        pruned: False when the budget covers every visual token (nothing was removed).
        stages: every stage in order.
    """

    kept: torch.Tensor
    n_visual: torch.Tensor
    prior: torch.Tensor | None
    posterior: torch.Tensor | None
    scores: torch.Tensor | None
    visual_start: torch.Tensor
    positions: torch.Tensor
    padding: torch.Tensor
    pruned: bool
    stages: tuple[StageResult, ...]


@dataclass
class _CacheRecord:
    """How a pruned cache differs from the sequence it stands for."""

    keep: torch.Tensor  # [B, S_prompt] bool, True where the prompt token is still cached
    padding: torch.Tensor  # [B, S_cached] bool, True at cached prompt tokens masked from every query
    dropped: int  # prompt tokens removed from every row
    logical_length: int  # tokens the cache stands for, pruned ones included
    next_position: torch.Tensor  # [B] text position of the next token


@dataclass
class _Prefill:
    """State of one prefill forward pass, from the model's pre-hook to its post-hook.

    Positions are absolute prompt positions; ``index`` [B, S'] maps the current (shorter) sequence to
    them, and ``padding`` [B, S'] flags the pruned tokens that stay only to give rows one length.
    """

    pools: list[Pool]
    layers: list[int]  # stage layers still to run, in order
    visual: torch.Tensor  # [B, S] True on every visual token
    key_valid: torch.Tensor  # [B, S] False on padding
    last_row: torch.Tensor  # [B] last non-padding position
    next_position: torch.Tensor  # [B]
    index: torch.Tensor | None = None
    padding: torch.Tensor | None = None
    cache: Any = None
    captured: dict[str, Any] = field(default_factory=dict)
    done: list[StageResult] = field(default_factory=list)
    published: dict[str, torch.Tensor] | None = None
    memo: dict[int, Any] = field(default_factory=dict)

    @property
    def pending(self) -> int | None:
        """The next stage's scored layer, or None when every stage ran."""
        return self.layers[0] if self.layers else None

    def positions(self) -> torch.Tensor:
        """[B, S'] the absolute position of each column of the current sequence."""
        if self.index is not None:
            return self.index
        batch, seq = self.key_valid.shape
        return torch.arange(seq, device=self.key_valid.device).expand(batch, seq)

    def current(self) -> torch.Tensor:
        """[B, S] the current column of each absolute position, -1 where it was dropped."""
        if self.index is None:
            return self.positions()
        batch, seq = self.key_valid.shape
        current = torch.full((batch, seq), -1, dtype=torch.long, device=self.key_valid.device)
        columns = torch.arange(self.index.shape[1], device=current.device).expand_as(self.index)
        return current.scatter(1, self.index.to(current.device), columns)

    def gathered(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [B, S] at the current sequence's positions."""
        return values if self.index is None else values.gather(1, self.index.to(values.device))

    def current_padding(self) -> torch.Tensor:
        if self.padding is None:
            return torch.zeros_like(self.gathered(self.key_valid))
        return self.padding

    def survivors(self) -> torch.Tensor:
        """[B, K] absolute positions of every row's surviving visual tokens, padded with -1; ascending,
        as pools come in prompt order and each keeps its tokens in order."""
        rows = [[] for _ in range(self.key_valid.shape[0])]
        for pool in self.pools:
            rows[pool.row].append(pool.positions)
        return _pad_rows(
            [torch.cat(row) if row else self.visual.new_zeros(0, dtype=torch.long) for row in rows]
        )


def _pad_rows(rows: list[torch.Tensor], fill: float = -1) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into [B, max], padded with ``fill``."""
    width = max(row.numel() for row in rows)
    out = torch.full((len(rows), width), fill, dtype=rows[0].dtype, device=rows[0].device)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def _has_raw_pixels(call: dict) -> bool:
    """Whether a model call brings raw images or video, which the vision tower encodes inside it."""
    return any(call.get(key) is not None for key in compat.RAW_PIXEL_ARGUMENTS)


def _has_visual_inputs(call: dict) -> bool:
    """Whether a model call brings images (raw, or pre-encoded by ``generate()``)."""
    encoded = call.get("mm_encoder_outputs") or {}
    return _has_raw_pixels(call) or any(value is not None for value in encoded.values())


def _hidden_argument(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _replace_hidden_argument(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    kwargs["hidden_states"] = hidden
    return args, kwargs


class PruningEngine:
    """Hooks physical visual-token pruning into one model; ``detach()`` restores it exactly."""

    def __init__(self, model: nn.Module, adapter: FamilyAdapter, config: PruningConfig) -> None:
        self.model = model
        self.adapter = adapter
        self.config = config
        self.multimodal = adapter.multimodal_model(model)
        self.layers = adapter.decoder_layers(model)
        self.vision = adapter.vision_probe(model) if "vision" in config.method.needs else None
        self.last: PruneResult | None = None
        self._signature = inspect.signature(self.multimodal.forward)
        self._records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._prefill: _Prefill | None = None
        self._vision_capture: dict[str, torch.Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self) -> None:
        self._handles = [
            self.multimodal.register_forward_pre_hook(self._on_model_call, with_kwargs=True),
            self.multimodal.register_forward_hook(self._on_model_return),
        ]
        for index, layer in enumerate(self.layers):
            attention = self.adapter.attention(layer)
            self._handles.append(
                layer.register_forward_pre_hook(self._layer_call_hook(index), with_kwargs=True)
            )
            if "attention" in self.config.method.needs:
                self._handles += [
                    self.adapter.query_projection(attention).register_forward_hook(self._capture(index, "q")),
                    self.adapter.key_projection(attention).register_forward_hook(self._capture(index, "k")),
                ]
        if self.vision is not None:
            self._handles += [
                self.vision.query_projection.register_forward_hook(self._capture_vision("q")),
                self.vision.key_projection.register_forward_hook(self._capture_vision("k")),
            ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._prefill = None
        self._vision_capture = {}

    # -- model entry: prefill or continuation -------------------------------------------------------

    def _on_model_call(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = self._signature.bind_partial(*args, **kwargs)
        call = dict(bound.arguments)
        call.update(call.pop("kwargs", {}))
        self._prefill = None
        cache = call.get("past_key_values")
        if cache is not None and compat.cache_length(cache) > 0:
            record = self._records.get(cache)
            if record is not None:
                self._continue(call, cache, record)
            return (), call
        if _has_raw_pixels(call):
            self._vision_capture = {}  # the tower runs inside this call; generate() runs it before
        self._prefill = self._plan(call)
        return (), call

    def _on_model_return(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._prefill = None
        self._vision_capture = {}

    def _plan(self, call: dict) -> _Prefill | None:
        """Find every row's images and videos and check that the prompt can be pruned."""
        input_ids = call.get("input_ids")
        if input_ids is None:
            return self._skip(
                "the model was called with inputs_embeds only, so the image tokens cannot be found"
            )
        items = self.adapter.visual_items(self.model.config, input_ids)
        if not items:
            return self._skip("the prompt has no image tokens")
        batch, seq = input_ids.shape
        device = input_ids.device
        visual = torch.zeros(batch, seq, dtype=torch.bool, device=device)
        for item in items:
            visual[item.row, item.positions] = True
        key_valid = compat.padding_mask(call.get("attention_mask"), batch, seq, device)
        last_row = seq - 1 - key_valid.flip(1).int().argmax(dim=1)  # [B] last non-padding position
        pools = make_pools(
            items,
            lambda n, part: self.config.plan(n, len(self.layers), part),
            self.config.multi_image,
            self.config.separator_offset,
        )
        if "attention" in self.config.method.needs:
            for pool in pools:
                self._check_separators(pool, visual, key_valid)
        text_positions = self.adapter.text_positions(self.model, call.get("position_ids"))
        if text_positions is None:
            next_position = torch.full((batch,), seq, device=device)
        else:
            next_position = text_positions.amax(dim=-1).expand(batch) + 1
        prefill = _Prefill(
            pools=pools,
            layers=sorted({layer for pool in pools for layer in pool.stages}),
            visual=visual,
            key_valid=key_valid,
            last_row=last_row,
            next_position=next_position,
        )
        if not prefill.layers:  # the budget covers every visual token
            self._finish(prefill)
            return None
        return prefill

    def _check_separators(self, pool: Pool, visual: torch.Tensor, key_valid: torch.Tensor) -> None:
        """Each item's prior slot must be a real text token, and an instruction must follow it."""
        seq = visual.shape[1]
        row = pool.row
        for separator in pool.separators:
            if separator >= seq:
                raise ValueError(
                    f"an image ends the prompt: the separator slot ({self.adapter.separator_token}, offset "
                    f"{self.config.separator_offset}) does not exist. Put the instruction after the image"
                )
            if not bool(key_valid[row, separator]) or bool(visual[row, separator]):
                raise ValueError(
                    "the separator slot after an image is a padding or visual token; check the attention "
                    "mask and separator_offset"
                )
        after = max(pool.separators) + 1
        text = key_valid[row, after:] & ~visual[row, after:]
        if self.config.posterior_rows == "after_separator" and not bool(text.any()):
            raise ValueError(
                "no instruction token follows the separator, so there is no posterior to score with; put the "
                "question after the image, or use posterior_rows='from_separator'"
            )

    def _skip(self, reason: str) -> None:
        if self.config.strict:
            raise ValueError(f"cannot prune: {reason} (strict=True)")
        warnings.warn(f"priortr: pruning skipped, {reason}", PruningSkippedWarning, stacklevel=4)
        return None

    def _continue(self, call: dict, cache: object, record: _CacheRecord) -> None:
        """Make a decode step or a later chat turn line up with a cache pruned at the first turn."""
        if _has_visual_inputs(call):
            raise ValueError(
                "new images on a pruned cache are not supported: the cache was pruned at the first turn; "
                "start a new cache for a new image"
            )
        inputs_key = "input_ids" if call.get("input_ids") is not None else "inputs_embeds"
        n_in = call[inputs_key].shape[1]
        batch = record.keep.shape[0]
        text_positions = self.adapter.text_positions(self.model, call.get("position_ids"))
        if text_positions is None:
            steps = torch.arange(n_in, device=record.next_position.device)
            text_positions = record.next_position[:, None] + steps
            call["position_ids"] = self.adapter.continuation_position_ids(self.model, text_positions)
        else:
            first = text_positions[..., 0].expand(batch).to(record.next_position.device)
            if bool((first != record.next_position).any()):
                if n_in > record.dropped and bool((first == record.next_position - record.dropped).all()):
                    # generate() sliced the whole conversation by the physical (shorter) cache length,
                    # so the first `dropped` inputs are already in the cache.
                    call[inputs_key] = call[inputs_key][:, record.dropped :]
                    for key in ("position_ids", "mm_token_type_ids", "token_type_ids"):
                        if isinstance(call.get(key), torch.Tensor):
                            call[key] = call[key][..., record.dropped :]
                    n_in -= record.dropped
                else:
                    raise ValueError(
                        "the inputs do not continue the pruned cache: expected text positions starting at "
                        f"{record.next_position.tolist()}, got {first.tolist()}"
                    )
        mask = call.get("attention_mask")
        if mask is None and bool(record.padding.any()):
            mask = torch.ones(
                batch, record.logical_length + n_in, dtype=torch.long, device=record.keep.device
            )
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            expected = record.logical_length + n_in
            if mask.shape[1] != expected:
                raise ValueError(
                    f"the attention mask covers {mask.shape[1]} tokens, but the pruned cache stands for "
                    f"{record.logical_length} tokens plus {n_in} new ones; "
                    "pass the mask of the whole conversation"
                )
            mask = drop_columns(mask, record.keep)
        if bool(record.padding.any()):
            mask = compat.hide_cached_columns(mask, record.padding)
        if mask is not None:
            call["attention_mask"] = mask
        record.logical_length += n_in
        record.next_position = record.next_position + n_in

    # -- decoder layers ----------------------------------------------------------------------------

    def _layer_call_hook(self, layer: int) -> Callable:
        """Before layer ``layer``: run the stage scored at the layer before it (so anything the model
        adds to the hidden states between layers, e.g. DeepStack features, is in), then hand the layer
        the gathered RoPE and mask, and note what a stage scored at this layer will need."""

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            prefill = self._prefill
            if prefill is None:
                return None
            if prefill.pending == layer - 1:
                if prefill.pending == BEFORE_LLM:
                    prefill.cache = kwargs.get("past_key_values")
                hidden = self._run_stage(prefill, _hidden_argument(args, kwargs))
                args, kwargs = _replace_hidden_argument(args, kwargs, hidden)
                if prefill.pending is None:
                    self._finish(prefill)
            if prefill.index is not None:
                self._gather_layer_inputs(prefill, kwargs)
            if prefill.pending == layer:
                cache = kwargs.get("past_key_values")
                if cache is not None:
                    compat.check_prunable_cache(cache, layer)
                prefill.cache = cache
                prefill.captured["rope"] = kwargs["position_embeddings"]
                prefill.captured["attention"] = self.adapter.attention(module)
            return args, kwargs

        return hook

    def _capture(self, layer: int, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            prefill = self._prefill
            if prefill is not None and prefill.pending == layer:
                prefill.captured[name] = output

        return hook

    def _capture_vision(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            self._vision_capture[name] = output

        return hook

    def _gather_layer_inputs(self, prefill: _Prefill, kwargs: dict) -> None:
        """RoPE and mask of a layer that runs on the kept tokens only."""
        seq = prefill.key_valid.shape[1]
        static = compat.is_static_cache(kwargs.get("past_key_values"))
        kwargs["position_embeddings"] = self._memo(
            kwargs["position_embeddings"],
            lambda rope: tuple(gather_sequence(part, prefill.index) for part in rope),
        )
        hidden = kwargs["position_embeddings"][0]
        implementation = getattr(self.model.config.get_text_config(), "_attn_implementation", None) or "sdpa"
        mask = kwargs.get("attention_mask")
        kwargs["attention_mask"] = self._memo(
            mask if mask is not None else prefill.index,
            lambda value: compat.gather_layer_mask(
                mask, prefill.index, seq, static, prefill.padding, implementation, hidden.dtype
            ),
        )
        # Gapped position ids would read as packed sequences to FlashAttention; RoPE is already applied
        # through the gathered (cos, sin), so layers need no position ids.
        if "position_ids" in kwargs:
            kwargs["position_ids"] = None

    def _memo(self, value: Any, make: Callable[[Any], Any]) -> Any:
        if value is None:
            return None
        memo = self._prefill.memo
        key = id(value)
        if key not in memo:
            memo[key] = (value, make(value))  # the original is held so its id stays unique
        return memo[key][1]

    # -- one pruning stage -------------------------------------------------------------------------

    @torch.no_grad()
    def _run_stage(self, prefill: _Prefill, hidden: torch.Tensor) -> torch.Tensor:
        """Select the visual tokens that survive this stage and cut everything else out of the sequence."""
        layer = prefill.layers.pop(0)
        current = prefill.current()  # [B, S]
        alive = ~prefill.current_padding()  # [B, S']
        merges = []
        changed = False
        attention = self._attention_rows(prefill) if "attention" in self.config.method.needs else None
        for pools, selection, visual_hidden in self._select(prefill, layer, hidden, current, attention):
            for g, pool in enumerate(pools):
                kept = selection.kept[g].to(current.device)
                columns = current[pool.row, pool.positions]
                alive[pool.row, columns] = False
                alive[pool.row, columns[kept]] = True
                if selection.merge is not None:
                    merges.append((pool.row, columns[kept], selection.merge[g], visual_hidden[g]))
                changed |= kept.numel() < pool.size or selection.merge is not None
                pool.keep(kept)
        if not changed:
            prefill.done.append(StageResult(layer, prefill.survivors(), merged=False))
            return hidden
        index = self._same_length(alive)  # [B, S''] current columns that stay
        out = gather_sequence(hidden, index)
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        for row, columns, weights, visual in merges:
            merged = torch.matmul(weights.to(hidden.device, dtype), visual.to(hidden.device, dtype))
            slots = torch.searchsorted(index[row].to(columns.device), columns)
            out[row, slots.to(out.device)] = merged.to(out.dtype)
        if layer != BEFORE_LLM and prefill.cache is not None:
            static = compat.is_static_cache(prefill.cache)
            for cache_layer in compat.cache_layers(prefill.cache)[: layer + 1]:
                compact_cache_layer(cache_layer, index, hidden.shape[1], static)
        padding = ~alive.gather(1, index)
        prefill.index = index if prefill.index is None else prefill.index.gather(1, index)
        prefill.padding = padding if bool(padding.any()) else None
        prefill.memo.clear()
        prefill.done.append(StageResult(layer, prefill.survivors(), bool(merges)))
        return out

    @staticmethod
    def _same_length(alive: torch.Tensor) -> torch.Tensor:
        """[B, S''] the columns to keep: every ``alive`` one, plus, in rows that kept fewer than the
        longest, their first dropped columns as padding so that every row has the same length."""
        missing = alive.sum(dim=1).amax() - alive.sum(dim=1)  # [B]
        dropped = ~alive
        filler = dropped & (dropped.long().cumsum(dim=1) <= missing[:, None])
        keep = alive | filler
        return keep.nonzero()[:, 1].view(alive.shape[0], -1)

    def _select(
        self,
        prefill: _Prefill,
        layer: int,
        hidden: torch.Tensor,
        current: torch.Tensor,
        attention: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> list[tuple[list[Pool], Selection, torch.Tensor]]:
        """Ask the method's selector, once per group of pools with equal size and budget."""
        groups: dict[tuple[int, int], list[Pool]] = {}
        for pool in prefill.pools:
            if layer in pool.stages:
                groups.setdefault((pool.size, min(pool.stages[layer], pool.size)), []).append(pool)
        method = self.config.method
        out = []
        for (size, budget), pools in groups.items():
            columns = torch.stack([current[pool.row, pool.positions] for pool in pools])  # [G, n]
            rows = torch.tensor([pool.row for pool in pools], device=hidden.device)
            visual_hidden = hidden[rows[:, None], columns.to(hidden.device)]  # [G, n, D]
            evidence: dict[str, Any] = {}
            pieces = None
            if attention is not None:
                pieces = [self._pool_attention(prefill, pool, attention, current) for pool in pools]
                evidence.update(self._stack_attention(pieces))
            if "vision" in method.needs:
                evidence.update(self._vision_evidence(prefill, pools))
            inputs = StageInputs(budget=budget, hidden=visual_hidden, seed=self.config.seed, **evidence)
            selection = method.select(inputs, **self.config.options)
            if selection.kept.shape[0] != len(pools) or selection.kept.shape[1] > size:
                raise ValueError(
                    f"method {method.name!r} kept {tuple(selection.kept.shape)} visual tokens for "
                    f"{len(pools)} images of {size} tokens"
                )
            if not prefill.done and selection.scores is not None and inputs.attention is not None:
                self._publish(prefill, pools, inputs, selection)
            out.append((pools, selection, visual_hidden))
        return out

    def _attention_rows(self, prefill: _Prefill) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention [B, H, R, S'] of every row's text rows from its earliest separator on, with their
        absolute positions [B, R] (-1 on padding rows): all the prior and posterior rows (App. A.3)."""
        captured = prefill.captured
        attention = captured["attention"]
        queries, keys = self.adapter.queries_and_keys(attention, captured["q"], captured["k"])
        batch = queries.shape[0]
        first = torch.full((batch,), prefill.visual.shape[1], device=prefill.visual.device)
        for pool in prefill.pools:
            first[pool.row] = min(int(first[pool.row]), min(pool.separators))
        absolute = prefill.positions().to(first.device)
        text = prefill.gathered(prefill.key_valid & ~prefill.visual) & (absolute >= first[:, None])
        counts = text.sum(dim=1)
        width = max(int(counts.max()), 1)
        order = torch.sort(text.long(), dim=1, descending=True, stable=True).indices[:, :width]  # [B, R]
        real = torch.arange(width, device=order.device)[None] < counts[:, None]
        rows = torch.where(real, order, 0)
        cos, sin = captured["rope"]
        cos_rows, sin_rows = gather_sequence(cos, rows), gather_sequence(sin, rows)
        picked = queries.gather(
            2, rows[:, None, :, None].expand(-1, queries.shape[1], -1, queries.shape[-1]).to(queries.device)
        )
        picked = apply_rope(picked, cos_rows, sin_rows)  # [B, H, R, d]
        keys = apply_rope(keys, cos, sin)  # [B, Hkv, S', d]
        key_valid = prefill.gathered(prefill.key_valid) & ~prefill.current_padding()
        attn = attention_rows(picked, keys, RowSpec(rows, key_valid), attention.scaling)
        return attn, torch.where(real, absolute.gather(1, rows), -1)

    def _pool_attention(
        self,
        prefill: _Prefill,
        pool: Pool,
        attention: tuple[torch.Tensor, torch.Tensor],
        current: torch.Tensor,
    ) -> PoolAttention:
        attn, row_positions = attention
        columns = current[pool.row, pool.positions].to(attn.device)
        last_row = int(prefill.last_row[pool.row])
        return pool_attention(
            attn[pool.row], row_positions[pool.row], columns, pool, last_row, self.config.posterior_rows
        )

    def _stack_attention(self, pieces: list[PoolAttention]) -> dict[str, Any]:
        """The ``StageInputs`` attention fields of a group of pools."""
        posterior = torch.stack([piece.rows for piece in pieces])  # [G, H, R, n]
        valid = torch.stack([piece.valid for piece in pieces])  # [G, R]
        evidence = build_evidence(
            torch.stack([piece.prior for piece in pieces]),
            posterior,
            valid,
            torch.stack([piece.last for piece in pieces]),
            heads=self.config.heads,
            seed=self.config.seed,
        )
        text_rows = aggregate_heads(posterior.transpose(1, 2).float(), self.config.heads)  # [G, R, n]
        return {"attention": evidence, "text_rows": text_rows, "text_valid": valid}

    def _vision_evidence(self, prefill: _Prefill, pools: list[Pool]) -> dict[str, Any]:
        """The vision tower's [CLS] attention and keys over each pool's tokens, captured when it ran;
        the tower encodes the batch's images in prompt order, one image per item."""
        capture = self._vision_capture
        if "q" not in capture or "k" not in capture:
            raise ValueError(
                f"method {self.config.method.name!r} needs the vision tower's attention, but the tower did "
                "not run for this prompt; pass pixel_values (not precomputed image features)"
            )
        probe = self.vision
        cls, keys = cls_attention(capture["q"], capture["k"], probe.heads, probe.scaling, probe.first_token)
        images = [item for pool in prefill.pools for item in pool.items]
        if any(item.modality != "image" for item in images) or len(images) != cls.shape[0]:
            raise ValueError(
                f"the vision tower saw {cls.shape[0]} images but the prompts hold {len(images)} visual "
                "items; [CLS]-ranked methods need one tower image per prompt image"
            )
        slot = {id(item): index for index, item in enumerate(images)}
        out_cls, out_keys = [], []
        for pool in pools:
            image = torch.tensor([slot[id(item)] for item in pool.items], device=cls.device)[pool.item_of]
            offset = pool.offset.to(cls.device)
            if int(offset.max()) >= cls.shape[1]:
                raise ValueError(
                    f"the vision tower gave {cls.shape[1]} tokens per image but an image has more visual "
                    "tokens in the prompt; use the processor's image size"
                )
            out_cls.append(cls[image, offset])
            out_keys.append(keys[image, :, offset].transpose(0, 1))
        return {"vision_cls": torch.stack(out_cls), "vision_keys": torch.stack(out_keys)}

    @staticmethod
    def _publish(prefill: _Prefill, pools: list[Pool], inputs: StageInputs, selection: Selection) -> None:
        """Keep the first stage's Q, P and scores of every pool, by absolute position, for ``last``."""
        published = prefill.published
        if published is None:
            published = prefill.published = {
                name: torch.full(prefill.visual.shape, float("nan"), device=prefill.visual.device)
                for name in ("prior", "posterior", "scores")
            }
        values = {
            "prior": inputs.attention.prior,
            "posterior": inputs.attention.posterior,
            "scores": selection.scores,
        }
        for g, pool in enumerate(pools):
            for name, tensor in values.items():
                published[name][pool.row, pool.positions] = tensor[g].float().to(published[name].device)

    def _finish(self, prefill: _Prefill) -> None:
        """Publish ``last`` and remember the pruned cache once the last stage ran."""
        batch, seq = prefill.key_valid.shape
        device = prefill.key_valid.device
        pruned = prefill.index is not None
        visual = prefill.visual
        published = prefill.published
        if published is not None:
            published = {
                name: _pad_rows([values[row][visual[row]] for row in range(batch)], float("nan"))
                for name, values in published.items()
            }
        padding = prefill.current_padding()
        self.last = PruneResult(
            kept=prefill.done[-1].kept if prefill.done else prefill.survivors(),
            n_visual=visual.sum(dim=1),
            prior=None if published is None else published["prior"],
            posterior=None if published is None else published["posterior"],
            scores=None if published is None else published["scores"],
            visual_start=visual.int().argmax(dim=1),
            positions=prefill.positions(),
            padding=padding,
            pruned=pruned,
            stages=tuple(prefill.done),
        )
        if pruned and prefill.cache is not None:
            keep = torch.zeros(batch, seq, dtype=torch.bool, device=device)
            keep.scatter_(1, prefill.index.to(device), True)
            self._records[prefill.cache] = _CacheRecord(
                keep=keep,
                padding=padding,
                dropped=seq - prefill.index.shape[1],
                logical_length=seq,
                next_position=prefill.next_position,
            )
        if not pruned:
            self._prefill = None
