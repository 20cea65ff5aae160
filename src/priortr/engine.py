"""The pruning engine: the only code that touches hidden states, masks, positions and the KV cache.

It attaches PyTorch module hooks to a stock transformers model (no copied modeling code) and, during
the prefill of a prompt with an image:

1. records the image span from ``input_ids`` (the separator is the slot right after it, Appendix A.3);
2. at decoder layer L (0-indexed) captures the layer's query/key projections and recomputes only the
   rows from the separator on (``probe.attention_rows``), builds prior/posterior evidence and scores
   every visual token with the chosen rule;
3. keeps the top-K visual tokens: the output hidden states of layer L and the KV cache of layers
   0..L are gathered, and layers L+1.. receive gathered RoPE (cos, sin) and masks, so kept tokens
   keep their original positions (paper Algorithm 1, Phase 3);
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
from priortr.probe import RowSpec, apply_rope, attention_rows
from priortr.scoring import RuleInfo, build_evidence, resolve_budget, select_top_k
from priortr.surgery import compact_cache_layer, drop_columns, gather_sequence

POSTERIOR_ROWS = ("after_separator", "from_separator", "last")
HEAD_AGGREGATIONS = ("mean", "max")


class PruningSkippedWarning(UserWarning):
    """A forward pass ran unpruned because its prompt has nothing to prune."""


@dataclass(frozen=True)
class PruningConfig:
    """What to prune and how; validated by ``priortr.apply``.

    ``layer`` is the 0-indexed decoder layer whose attention is scored; layers ``layer+1 ..`` run on
    the kept tokens (the authors' code calls this "prune layer layer+1"). ``posterior_rows`` chooses
    the rows averaged into P: every prompt token after the separator (default), the separator too (as
    the authors' code does), or the last prompt token only. ``separator_offset`` moves the prior's slot
    that many tokens after the first post-image token (the paper's null-token ablation).
    """

    rule: RuleInfo
    budget: int | float
    layer: int
    heads: str = "mean"
    posterior_rows: str = "after_separator"
    separator_offset: int = 0
    strict: bool = False
    seed: int = 0


@dataclass(frozen=True)
class PruneResult:
    """What one pruned prefill kept, and why (``handle.last``).

    Attributes:
        kept: [B, K] absolute prompt positions of the kept visual tokens, ascending.
        prior, posterior, scores: [B, N] float32 Q, P and the rule's scores over the visual tokens.
        visual_start: [B] absolute position of each row's first visual token.
        positions: [B, S'] original prompt position of every token left after layer L, i.e. of each row
            of the logits that a plain forward returns.
        pruned: False when the budget covers every visual token (nothing was removed).
    """

    kept: torch.Tensor
    prior: torch.Tensor
    posterior: torch.Tensor
    scores: torch.Tensor
    visual_start: torch.Tensor
    positions: torch.Tensor
    pruned: bool


@dataclass
class _CacheRecord:
    """How a pruned cache differs from the sequence it stands for."""

    keep: torch.Tensor  # [B, S_prompt] bool, True where the prompt token is still cached
    dropped: int  # visual tokens removed from every row
    logical_length: int  # tokens the cache stands for, pruned ones included
    next_position: torch.Tensor  # [B] text position of the next token


@dataclass
class _Prefill:
    """State of one prefill forward pass, from the model's pre-hook to its post-hook."""

    start: torch.Tensor  # [B] first visual position
    separator: torch.Tensor  # [B] prior row
    n_visual: int
    budget: int
    key_valid: torch.Tensor  # [B, S] False on padding
    last_row: torch.Tensor  # [B] last non-padding position
    posterior_rows: str
    next_position: torch.Tensor  # [B]
    captured: dict[str, Any] = field(default_factory=dict)
    index: torch.Tensor | None = None  # [B, S'] once pruned
    memo: dict[int, Any] = field(default_factory=dict)

    def posterior_valid(self, first_row: int, n_rows: int) -> torch.Tensor:
        """[B, R] which of the rows ``first_row ..`` are averaged into P (see ``PruningConfig``)."""
        position = torch.arange(first_row, first_row + n_rows, device=self.key_valid.device)[None]  # [1, R]
        if self.posterior_rows == "last":
            return position == self.last_row[:, None]
        if self.posterior_rows == "after_separator":
            after = position > self.separator[:, None]
        else:
            after = position >= self.separator[:, None]
        return after & self.key_valid[:, first_row:]


def _has_visual_inputs(call: dict) -> bool:
    """Whether a model call brings images (raw, or pre-encoded by ``generate()``)."""
    encoded = call.get("mm_encoder_outputs") or {}
    return any(call.get(key) is not None for key in ("pixel_values", "pixel_values_videos")) or any(
        value is not None for value in encoded.values()
    )


class PruningEngine:
    """Hooks PriorTR-style physical pruning into one model; ``detach()`` restores it exactly."""

    def __init__(self, model: nn.Module, adapter: FamilyAdapter, config: PruningConfig) -> None:
        self.model = model
        self.adapter = adapter
        self.config = config
        self.multimodal = adapter.multimodal_model(model)
        self.layers = adapter.decoder_layers(model)
        self.attention = adapter.attention(self.layers[config.layer])
        self.last: PruneResult | None = None
        self._signature = inspect.signature(self.multimodal.forward)
        self._records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._prefill: _Prefill | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self) -> None:
        layer = self.layers[self.config.layer]
        self._handles = [
            self.multimodal.register_forward_pre_hook(self._on_model_call, with_kwargs=True),
            self.multimodal.register_forward_hook(self._on_model_return),
            layer.register_forward_pre_hook(self._on_scoring_layer_call, with_kwargs=True),
            self.adapter.query_projection(self.attention).register_forward_hook(self._capture("queries")),
            self.adapter.key_projection(self.attention).register_forward_hook(self._capture("keys")),
            layer.register_forward_hook(self._on_scoring_layer_return),
        ]
        for later in self.layers[self.config.layer + 1 :]:
            self._handles.append(
                later.register_forward_pre_hook(self._on_pruned_layer_call, with_kwargs=True)
            )

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._prefill = None

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
        self._prefill = self._plan(call)
        return (), call

    def _on_model_return(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._prefill = None

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
        separator = start + n_visual + self.config.separator_offset
        if int(separator.max()) >= seq:
            raise ValueError(
                f"the image ends the prompt: the separator slot ({self.adapter.separator_token}, offset "
                f"{self.config.separator_offset}) does not exist. Put the instruction after the image"
            )
        key_valid = compat.padding_mask(call.get("attention_mask"), batch, seq, input_ids.device)
        if not bool(key_valid.gather(1, separator[:, None]).all()):
            raise ValueError(
                "the separator slot after the image is a padding token; check the attention mask"
            )
        last_row = seq - 1 - key_valid.flip(1).int().argmax(dim=1)  # [B] last non-padding position
        if self.config.posterior_rows == "after_separator" and bool((separator >= last_row).any()):
            raise ValueError(
                "no instruction token follows the separator, so there is no posterior to score with; put the "
                "question after the image, or use posterior_rows='from_separator'"
            )
        text_positions = self.adapter.text_positions(self.model, call.get("position_ids"))
        if text_positions is None:
            next_position = torch.full((batch,), seq, device=input_ids.device)
        else:
            next_position = text_positions.amax(dim=-1).expand(batch) + 1
        return _Prefill(
            start=start,
            separator=separator,
            n_visual=n_visual,
            budget=resolve_budget(self.config.budget, n_visual),
            key_valid=key_valid,
            last_row=last_row,
            posterior_rows=self.config.posterior_rows,
            next_position=next_position,
        )

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

    # -- scoring layer -----------------------------------------------------------------------------

    def _on_scoring_layer_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        prefill = self._prefill
        if prefill is None:
            return
        cache = kwargs.get("past_key_values")
        if cache is not None:
            compat.check_prunable_cache(cache, self.config.layer)
        prefill.captured["cache"] = cache
        prefill.captured["rope"] = kwargs["position_embeddings"]

    def _capture(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if self._prefill is not None:
                self._prefill.captured[name] = output

        return hook

    def _on_scoring_layer_return(self, module: nn.Module, args: tuple, output: Any) -> Any:
        prefill = self._prefill
        if prefill is None:
            return None
        kept, evidence, scores = self._score(prefill)
        batch, seq = prefill.key_valid.shape
        keep = torch.ones(batch, seq, dtype=torch.bool, device=kept.device)
        visual = prefill.start[:, None] + torch.arange(prefill.n_visual, device=kept.device)  # [B, N]
        keep.scatter_(1, visual, False)
        keep.scatter_(1, kept, True)
        index = keep.nonzero()[:, 1].view(batch, -1)  # [B, S']
        pruned = prefill.budget < prefill.n_visual
        self.last = PruneResult(
            kept=kept,
            prior=evidence.prior,
            posterior=evidence.posterior,
            scores=scores,
            visual_start=prefill.start,
            positions=index if pruned else torch.arange(seq, device=kept.device).expand(batch, seq),
            pruned=pruned,
        )
        if not pruned:
            self._prefill = None
            return None
        prefill.index = index
        cache = prefill.captured["cache"]
        if cache is not None:
            static = compat.is_static_cache(cache)
            for layer in compat.cache_layers(cache)[: self.config.layer + 1]:
                compact_cache_layer(layer, index, seq, static)
            self._records[cache] = _CacheRecord(
                keep=keep,
                dropped=prefill.n_visual - prefill.budget,
                logical_length=seq,
                next_position=prefill.next_position,
            )
        prefill.captured.clear()
        return compat.map_hidden_states(output, lambda hidden: gather_sequence(hidden, index))

    @torch.no_grad()
    def _score(self, prefill: _Prefill):
        """Prior, posterior and scores from the rows after the image (Appendix A.3)."""
        captured = prefill.captured
        queries, keys = self.adapter.queries_and_keys(self.attention, captured["queries"], captured["keys"])
        first = int(prefill.separator.min())
        cos, sin = captured["rope"]
        queries = apply_rope(queries[:, :, first:], cos[:, first:], sin[:, first:])  # [B, H, R, d]
        keys = apply_rope(keys, cos, sin)  # [B, Hkv, S, d]
        attn = attention_rows(queries, keys, RowSpec(first, prefill.key_valid), self.attention.scaling)
        batch, heads, n_rows, _ = attn.shape
        n = prefill.n_visual
        columns = prefill.start[:, None] + torch.arange(n, device=attn.device)  # [B, N]
        visual = attn.gather(3, columns[:, None, None, :].expand(batch, heads, n_rows, n))  # [B, H, R, N]

        def row(position: torch.Tensor) -> torch.Tensor:
            at = (position - first)[:, None, None, None].expand(batch, heads, 1, n)
            return visual.gather(2, at).squeeze(2)  # [B, H, N]

        evidence = build_evidence(
            row(prefill.separator),
            visual,
            prefill.posterior_valid(first, n_rows),
            row(prefill.last_row),
            heads=self.config.heads,
            seed=self.config.seed,
        )
        scores = self.config.rule.fn(evidence)
        kept = prefill.start[:, None] + select_top_k(scores, prefill.budget)
        return kept, evidence, scores

    # -- layers after the prune --------------------------------------------------------------------

    def _on_pruned_layer_call(
        self, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        prefill = self._prefill
        if prefill is None or prefill.index is None:
            return None
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
        return args, kwargs

    def _memo(self, value: Any, make: Callable[[Any], Any]) -> Any:
        if value is None:
            return None
        memo = self._prefill.memo
        key = id(value)
        if key not in memo:
            memo[key] = (value, make(value))  # the original is held so its id stays unique
        return memo[key][1]
