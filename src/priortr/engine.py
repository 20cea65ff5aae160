"""The pruning engine: the only code that touches hidden states, masks, positions and the KV cache.

It attaches PyTorch module hooks to a stock transformers model (no copied modeling code) and, during
the prefill of a prompt with an image:

1. records the image span from ``input_ids`` (the separator is the slot right after it, Appendix A.3)
   and plans the method's stages: before the language model, after one decoder layer, or after
   several (``priortr.methods``);
2. at each stage gathers the evidence the method asks for: attention rows recomputed from the scored
   layer's own query/key projections (``probe.attention_rows``), the visual tokens' hidden states,
   the vision tower's [CLS] attention, and calls the method's selector;
3. keeps the selected visual tokens (merging hidden states where the selector says so): the hidden
   states, the KV cache of layers 0..L are gathered, and later layers receive gathered RoPE (cos, sin)
   and masks, so kept tokens keep their original positions (paper Algorithm 1, Phase 3);
4. remembers, per cache object, which prompt columns were dropped, so that decode steps and later
   chat turns on the same cache get masks and positions that match the shorter cache.
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
from priortr.methods import MethodInfo
from priortr.probe import RowSpec, apply_rope, attention_rows, cls_attention
from priortr.scoring import Evidence, aggregate_heads, build_evidence, resolve_budget
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
    (the paper's null-token ablation).
    """

    method: MethodInfo
    budget: int | float
    layer: int
    stages: tuple[tuple[int, int | float], ...] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    heads: str = "mean"
    posterior_rows: str = "after_separator"
    separator_offset: int = 0
    strict: bool = False
    seed: int = 0

    def plan(self, n_visual: int, n_layers: int) -> list[tuple[int, int]]:
        """The (layer, tokens kept after it) stages for an image of ``n_visual`` tokens."""
        if self.stages is not None:
            return [(layer, resolve_budget(budget, n_visual)) for layer, budget in self.stages]
        kept = resolve_budget(self.budget, n_visual)
        if self.method.schedule is not None:
            return self.method.schedule(kept, n_visual, self.layer, n_layers)
        return [(BEFORE_LLM if self.method.where == "vision" else self.layer, kept)]


@dataclass(frozen=True)
class StageResult:
    """One stage of a pruned prefill: the scored layer (-1: before the LLM) and what survived it.

    ``kept`` [B, K] holds absolute prompt positions, ascending; ``merged`` says whether survivors
    carry merged hidden states.
    """

    layer: int
    kept: torch.Tensor
    merged: bool


@dataclass(frozen=True)
class PruneResult:
    """What one pruned prefill kept, and why (``handle.last``).

    Attributes:
        kept: [B, K] absolute prompt positions of the visual tokens left after the last stage, ascending.
        n_visual: visual tokens of each image before pruning (N).
        prior, posterior, scores: [B, N] float32 Q, P and the rule's scores over the visual tokens at
            the first stage, for methods that rank by a scoring rule; None otherwise.
        visual_start: [B] absolute position of each row's first visual token.
        positions: [B, S'] original prompt position of every token left after the last stage, i.e. of
            each row of the logits that a plain forward returns.
        pruned: False when the budget covers every visual token (nothing was removed).
        stages: every stage in order.
    """

    kept: torch.Tensor
    n_visual: int
    prior: torch.Tensor | None
    posterior: torch.Tensor | None
    scores: torch.Tensor | None
    visual_start: torch.Tensor
    positions: torch.Tensor
    pruned: bool
    stages: tuple[StageResult, ...]


@dataclass
class _CacheRecord:
    """How a pruned cache differs from the sequence it stands for."""

    keep: torch.Tensor  # [B, S_prompt] bool, True where the prompt token is still cached
    dropped: int  # visual tokens removed from every row
    logical_length: int  # tokens the cache stands for, pruned ones included
    next_position: torch.Tensor  # [B] text position of the next token


@dataclass
class _Prefill:
    """State of one prefill forward pass, from the model's pre-hook to its post-hook.

    Positions are absolute prompt positions; ``index`` maps the current (shorter) sequence to them.
    Text before the image is never dropped, so each row's visual tokens stay one run from ``start``.
    """

    start: torch.Tensor  # [B] first visual position
    separator: torch.Tensor  # [B] prior row
    n_visual: int
    stages: list[tuple[int, int]]  # (layer, kept) still to run, in order
    key_valid: torch.Tensor  # [B, S] False on padding
    last_row: torch.Tensor  # [B] last non-padding position
    posterior_rows: str
    next_position: torch.Tensor  # [B]
    n_current: int = 0  # visual tokens left
    index: torch.Tensor | None = None  # [B, S'] once pruned
    cache: Any = None
    captured: dict[str, Any] = field(default_factory=dict)
    done: list[StageResult] = field(default_factory=list)
    first_scores: tuple[Evidence, torch.Tensor] | None = None
    memo: dict[int, Any] = field(default_factory=dict)

    @property
    def shift(self) -> int:
        """Visual tokens dropped so far: every position after the image moved this far forward."""
        return self.n_visual - self.n_current

    def current_key_valid(self) -> torch.Tensor:
        return self.key_valid if self.index is None else self.key_valid.gather(1, self.index)

    def visual_columns(self) -> torch.Tensor:
        """[B, N'] current positions of the visual tokens left."""
        return self.start[:, None] + torch.arange(self.n_current, device=self.start.device)

    def posterior_valid(self, first_row: int, n_rows: int) -> torch.Tensor:
        """[B, R] which current rows ``first_row ..`` are averaged into P (see ``PruningConfig``)."""
        position = torch.arange(first_row, first_row + n_rows, device=self.key_valid.device)[None]  # [1, R]
        if self.posterior_rows == "last":
            return position == (self.last_row - self.shift)[:, None]
        separator = (self.separator - self.shift)[:, None]
        after = position > separator if self.posterior_rows == "after_separator" else position >= separator
        return after & self.current_key_valid()[:, first_row:]


def _has_raw_pixels(call: dict) -> bool:
    """Whether a model call brings raw images or video, which the vision tower encodes inside it."""
    return any(call.get(key) is not None for key in ("pixel_values", "pixel_values_videos"))


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
            self._handles += [
                layer.register_forward_pre_hook(self._layer_call_hook(index), with_kwargs=True),
                layer.register_forward_hook(self._layer_return_hook(index)),
            ]
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
        """Find the image span of every row and check that the prompt can be pruned."""
        input_ids = call.get("input_ids")
        if input_ids is None:
            return self._skip(
                "the model was called with inputs_embeds only, so the image tokens cannot be found"
            )
        token_ids = self.adapter.visual_token_ids(self.model.config)
        for modality, token_id in token_ids.items():
            if modality != "image" and bool((input_ids == token_id).any()):
                raise ValueError(
                    f"the prompt holds {modality} tokens; priortr prunes image tokens only for this family"
                )
        is_visual = input_ids == token_ids["image"]  # [B, S]
        counts = is_visual.sum(dim=1)
        if int(counts.max()) == 0:
            return self._skip("the prompt has no image tokens")
        if int(counts.min()) != int(counts.max()):
            raise ValueError(
                f"rows of the batch hold different numbers of visual tokens ({counts.tolist()}); "
                "run them in separate batches"
            )
        batch, seq = input_ids.shape
        n_visual = int(counts[0])
        start = is_visual.int().argmax(dim=1)  # [B]
        if not self._contiguous(is_visual, start, n_visual):
            raise ValueError(
                "a prompt holds several images (or a split image span); priortr prunes one image per prompt"
            )
        needs_attention = "attention" in self.config.method.needs
        separator = start + n_visual + self.config.separator_offset
        if needs_attention and int(separator.max()) >= seq:
            raise ValueError(
                f"the image ends the prompt: the separator slot ({self.adapter.separator_token}, offset "
                f"{self.config.separator_offset}) does not exist. Put the instruction after the image"
            )
        key_valid = compat.padding_mask(call.get("attention_mask"), batch, seq, input_ids.device)
        separator = separator.clamp(max=seq - 1)
        if needs_attention and not bool(key_valid.gather(1, separator[:, None]).all()):
            raise ValueError(
                "the separator slot after the image is a padding token; check the attention mask"
            )
        last_row = seq - 1 - key_valid.flip(1).int().argmax(dim=1)  # [B] last non-padding position
        if (
            needs_attention
            and self.config.posterior_rows == "after_separator"
            and bool((separator >= last_row).any())
        ):
            raise ValueError(
                "no instruction token follows the separator, so there is no posterior to score with; put the "
                "question after the image, or use posterior_rows='from_separator'"
            )
        text_positions = self.adapter.text_positions(self.model, call.get("position_ids"))
        if text_positions is None:
            next_position = torch.full((batch,), seq, device=input_ids.device)
        else:
            next_position = text_positions.amax(dim=-1).expand(batch) + 1
        prefill = _Prefill(
            start=start,
            separator=separator,
            n_visual=n_visual,
            n_current=n_visual,
            stages=self.config.plan(n_visual, len(self.layers)),
            key_valid=key_valid,
            last_row=last_row,
            posterior_rows=self.config.posterior_rows,
            next_position=next_position,
        )
        if not prefill.stages:  # the budget covers every visual token
            self._finish(prefill)
            return None
        return prefill

    @staticmethod
    def _contiguous(is_visual: torch.Tensor, start: torch.Tensor, n_visual: int) -> bool:
        """Whether each row's N visual tokens form one run starting at ``start``."""
        span = start[:, None] + torch.arange(n_visual, device=start.device)  # [B, N]
        if int(span.max()) >= is_visual.shape[1]:
            return False
        return bool(is_visual.gather(1, span).all())

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
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            expected = record.logical_length + n_in
            if mask.shape[1] != expected:
                raise ValueError(
                    f"the attention mask covers {mask.shape[1]} tokens, but the pruned cache stands for "
                    f"{record.logical_length} tokens plus {n_in} new ones; "
                    "pass the mask of the whole conversation"
                )
            call["attention_mask"] = drop_columns(mask, record.keep)
        record.logical_length += n_in
        record.next_position = record.next_position + n_in

    # -- decoder layers ----------------------------------------------------------------------------

    def _layer_call_hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            prefill = self._prefill
            if prefill is None:
                return None
            if layer == 0 and prefill.stages and prefill.stages[0][0] == BEFORE_LLM:
                prefill.cache = kwargs.get("past_key_values")
                hidden = self._run_stage(prefill, _hidden_argument(args, kwargs))
                args, kwargs = _replace_hidden_argument(args, kwargs, hidden)
                if not prefill.stages:
                    self._finish(prefill)
            if prefill.index is not None:
                self._gather_layer_inputs(prefill, kwargs)
            if prefill.stages and prefill.stages[0][0] == layer:
                cache = kwargs.get("past_key_values")
                if cache is not None:
                    compat.check_prunable_cache(cache, layer)
                prefill.cache = cache
                prefill.captured["rope"] = kwargs["position_embeddings"]
                prefill.captured["attention"] = self.adapter.attention(module)
            return args, kwargs

        return hook

    def _layer_return_hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            prefill = self._prefill
            if prefill is None or not prefill.stages or prefill.stages[0][0] != layer:
                return None
            new_output = compat.map_hidden_states(output, lambda hidden: self._run_stage(prefill, hidden))
            if not prefill.stages:
                self._finish(prefill)
            return new_output

        return hook

    def _capture(self, layer: int, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            prefill = self._prefill
            if prefill is not None and prefill.stages and prefill.stages[0][0] == layer:
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
        kwargs["attention_mask"] = self._memo(
            kwargs.get("attention_mask"),
            lambda mask: compat.gather_layer_mask(mask, prefill.index, seq, static),
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
        layer, budget = prefill.stages.pop(0)
        columns = prefill.visual_columns()  # [B, N']
        visual_hidden = gather_sequence(hidden, columns)  # [B, N', D]
        budget = min(budget, prefill.n_current)
        selection = self._select(prefill, budget, visual_hidden)
        prefill.captured.clear()
        batch, seq = hidden.shape[:2]
        kept = selection.kept.to(columns.device)
        if kept.shape[0] != batch or kept.shape[1] > prefill.n_current:
            raise ValueError(
                f"method {self.config.method.name!r} kept {tuple(kept.shape)} visual tokens for a batch of "
                f"{batch} images of {prefill.n_current} tokens"
            )
        if kept.shape[1] == prefill.n_current and selection.merge is None:
            prefill.done.append(StageResult(layer, self._absolute(prefill, columns), merged=False))
            return hidden
        keep = torch.ones(batch, seq, dtype=torch.bool, device=columns.device)
        keep.scatter_(1, columns, False)
        keep.scatter_(1, prefill.start[:, None] + kept, True)
        index = keep.nonzero()[:, 1].view(batch, -1)  # [B, S''] current positions kept
        out = gather_sequence(hidden, index)
        if selection.merge is not None:
            dtype = torch.promote_types(hidden.dtype, torch.float32)
            merged = torch.matmul(selection.merge.to(hidden.device, dtype), visual_hidden.to(dtype))
            slots = prefill.start[:, None] + torch.arange(kept.shape[1], device=columns.device)  # [B, K]
            out = out.scatter(
                1, slots[..., None].expand(-1, -1, out.shape[-1]).to(out.device), merged.to(out.dtype)
            )
        if layer != BEFORE_LLM and prefill.cache is not None:
            static = compat.is_static_cache(prefill.cache)
            for cache_layer in compat.cache_layers(prefill.cache)[: layer + 1]:
                compact_cache_layer(cache_layer, index, seq, static)
        prefill.index = index if prefill.index is None else prefill.index.gather(1, index)
        prefill.n_current = kept.shape[1]
        prefill.memo.clear()
        prefill.done.append(
            StageResult(layer, self._absolute(prefill, prefill.visual_columns()), selection.merge is not None)
        )
        return out

    def _select(self, prefill: _Prefill, budget: int, visual_hidden: torch.Tensor) -> Selection:
        """Gather the evidence the method needs and ask its selector."""
        method = self.config.method
        evidence: dict[str, Any] = {}
        if "attention" in method.needs:
            evidence.update(self._attention_evidence(prefill))
        if "vision" in method.needs:
            evidence.update(self._vision_evidence(visual_hidden.shape[0], prefill.n_current))
        inputs = StageInputs(budget=budget, hidden=visual_hidden, seed=self.config.seed, **evidence)
        selection = method.select(inputs, **self.config.options)
        if not prefill.done and inputs.attention is not None and selection.scores is not None:
            prefill.first_scores = (inputs.attention, selection.scores)
        return selection

    def _attention_evidence(self, prefill: _Prefill) -> dict[str, Any]:
        """Prior, posterior, last-token row and instruction rows from the rows after the image (App. A.3)."""
        captured = prefill.captured
        attention = captured["attention"]
        queries, keys = self.adapter.queries_and_keys(attention, captured["q"], captured["k"])
        first = int((prefill.separator - prefill.shift).min())
        cos, sin = captured["rope"]
        queries = apply_rope(queries[:, :, first:], cos[:, first:], sin[:, first:])  # [B, H, R, d]
        keys = apply_rope(keys, cos, sin)  # [B, Hkv, S, d]
        attn = attention_rows(queries, keys, RowSpec(first, prefill.current_key_valid()), attention.scaling)
        batch, heads, n_rows, _ = attn.shape
        n = prefill.n_current
        columns = prefill.visual_columns()  # [B, N]
        visual = attn.gather(3, columns[:, None, None, :].expand(batch, heads, n_rows, n))  # [B, H, R, N]

        def row(position: torch.Tensor) -> torch.Tensor:
            at = (position - prefill.shift - first)[:, None, None, None].expand(batch, heads, 1, n)
            return visual.gather(2, at).squeeze(2)  # [B, H, N]

        valid = prefill.posterior_valid(first, n_rows)
        evidence = build_evidence(
            row(prefill.separator),
            visual,
            valid,
            row(prefill.last_row),
            heads=self.config.heads,
            seed=self.config.seed,
        )
        text_rows = aggregate_heads(visual.transpose(1, 2).float(), self.config.heads)  # [B, R, N]
        return {"attention": evidence, "text_rows": text_rows, "text_valid": valid}

    def _vision_evidence(self, batch: int, n_visual: int) -> dict[str, Any]:
        """The vision tower's [CLS] attention and keys over the visual tokens, captured when it ran."""
        capture = self._vision_capture
        if "q" not in capture or "k" not in capture:
            raise ValueError(
                f"method {self.config.method.name!r} needs the vision tower's attention, but the tower did "
                "not run for this prompt; pass pixel_values (not precomputed image features)"
            )
        probe = self.vision
        cls, keys = cls_attention(capture["q"], capture["k"], probe.heads, probe.scaling, probe.first_token)
        if tuple(cls.shape) != (batch, n_visual):
            raise ValueError(
                f"the vision tower saw {tuple(cls.shape)} (images, tokens) but the prompt has {batch} x "
                f"{n_visual} visual tokens; one image per prompt, with the processor's image size"
            )
        return {"vision_cls": cls, "vision_keys": keys}

    @staticmethod
    def _absolute(prefill: _Prefill, columns: torch.Tensor) -> torch.Tensor:
        return columns if prefill.index is None else prefill.index.gather(1, columns)

    def _finish(self, prefill: _Prefill) -> None:
        """Publish ``last`` and remember the pruned cache once the last stage ran."""
        batch, seq = prefill.key_valid.shape
        device = prefill.start.device
        pruned = prefill.index is not None
        evidence, scores = prefill.first_scores or (None, None)
        kept = prefill.done[-1].kept if prefill.done else prefill.visual_columns()
        self.last = PruneResult(
            kept=kept,
            n_visual=prefill.n_visual,
            prior=None if evidence is None else evidence.prior,
            posterior=None if evidence is None else evidence.posterior,
            scores=scores,
            visual_start=prefill.start,
            positions=prefill.index if pruned else torch.arange(seq, device=device).expand(batch, seq),
            pruned=pruned,
            stages=tuple(prefill.done),
        )
        if pruned and prefill.cache is not None:
            keep = torch.zeros(batch, seq, dtype=torch.bool, device=device)
            keep.scatter_(1, prefill.index.to(device), True)
            self._records[prefill.cache] = _CacheRecord(
                keep=keep,
                dropped=prefill.shift,
                logical_length=seq,
                next_position=prefill.next_position,
            )
        if not pruned:
            self._prefill = None
