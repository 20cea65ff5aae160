"""Reference for pruning models whose layers are not all full attention, independent of ``priortr``:
sliding-window and chunked attention (Gemma 3, Llama 4, Mistral with a window) and linear attention
(Qwen3.5's Gated DeltaNet).

``tests.helpers.oracle`` keeps every token and replaces each layer's mask by causal-minus-pruned, which
fits full attention only. Here every layer runs as stock transformers runs it, on the tokens the pruned
model's layer would see:

* an attention layer keeps the mask transformers built for it (its sliding window, its chunks,
  Gemma 3's bidirectional image blocks, all in the prompt's own positions, since nothing is removed) and
  additionally hides the pruned key columns: from prompt queries in layers after the stage's layer, and
  from every generated query in every layer. Key column ``j`` of a layer call is prompt position
  ``j + kv_offset`` (``cache.get_mask_sizes``: a sliding layer's cache holds the window's tail only);
* a linear-attention layer after the stage's layer runs *on the kept tokens only* during the prefill: its
  input is gathered to them (rows left-padded to one length, the padding masked as transformers masks
  left padding), and its output scattered back; pruned positions pass their input through, and no kept
  token ever reads them (attention hides them, linear layers never see them). Its recurrent and
  convolution states are therefore those of the kept sequence; the layers up to the stage's layer saw
  every token, and so did their states. Decode steps bring one new token and run as stock; a call that
reruns the whole conversation without a cache (``generate(use_cache=False)``) gathers the prompt's kept
tokens and every later one.

A layer that reads an earlier layer's keys and values (Gemma 4's KV sharing) hides the columns that
layer's mask hides, and sees its queries at that layer's last positions.

So each layer is the stock layer applied to the pruned sequence, which is what physical pruning claims
to compute. The masks of attention layers are read where transformers leaves them (the layer call's
``attention_mask``), the layer kinds from ``config.layer_types``; the cache is taken by either name
transformers has passed it by (``cache`` from 5.24, ``past_key_values`` before).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

KEPT = 1 << 30
"""``last_seen`` of a prompt column that is never pruned."""

LINEAR_KINDS = ("linear_attention", "conv", "mamba")


def _cache(kwargs: dict) -> Any:
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _decoder(model: nn.Module) -> nn.Module:
    if not hasattr(model, "model"):  # Llama 4: the multimodal model itself holds the causal LM
        return model.language_model.model
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner.text_model


class _Reference:
    """What the hooks share: each prompt column's last layer of prompt queries that see it, the prompt's
    padding, and whether the running call is a prefill."""

    def __init__(self, model: nn.Module, stages: Sequence[tuple[int, torch.Tensor]], padding: torch.Tensor):
        first = stages[0][1]
        last_seen = torch.full(first.shape, KEPT, dtype=torch.long)
        for layer, pruned in stages:
            last_seen = torch.where(pruned.cpu() & (last_seen == KEPT), layer, last_seen)
        self.last_seen = last_seen  # [B, S]
        self.valid = padding.bool().cpu()  # [B, S]
        self.prompt = first.shape[1]
        self.prefill = False
        text = model.config.get_text_config()
        self.kinds = list(getattr(text, "layer_types", None) or [])
        self.gathered: dict[int, torch.Tensor] = {}
        self.sources = _kv_sources(text, self.kinds)
        self.places: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def kind(self, index: int) -> str:
        return self.kinds[index] if self.kinds else "full_attention"

    def on_decoder_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("inputs_embeds")
        cache = _cache(kwargs)
        empty = cache is None or int(cache.get_seq_length()) == 0
        self.prefill = empty and hidden is not None and hidden.shape[1] >= self.prompt

    def _places(self, index: int, kwargs: dict, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt positions of the layer call's queries [q] and keys [kv]. A layer that reads another
        layer's keys (KV sharing) has that layer's keys, and its queries are the last of that layer's
        (Gemma 4 runs its shared layers on the last ``logits_to_keep`` tokens alone)."""
        q_len = hidden.shape[1]
        source = self.sources.get(index)
        if source is not None:
            queries, keys = self.places[source]
            return queries[queries.shape[0] - q_len :], keys
        cache = _cache(kwargs)
        if cache is None:
            past, kv_len, kv_offset = 0, q_len, 0
        else:
            past = int(cache.get_seq_length(index))
            kv_len, kv_offset = (int(v) for v in cache.get_mask_sizes(q_len, index))
        device = hidden.device
        q_pos = torch.arange(past, past + q_len, device=device)  # [q]
        k_pos = torch.arange(kv_offset, kv_offset + kv_len, device=device)  # [kv]
        self.places[index] = q_pos, k_pos
        return q_pos, k_pos

    def attention_mask(self, index: int, kwargs: dict, hidden: torch.Tensor) -> Any:
        """The layer's own mask, with the pruned key columns hidden as the module docstring says."""
        q_pos, k_pos = self._places(index, kwargs, hidden)
        kv_len, device = k_pos.shape[0], hidden.device
        in_prompt = k_pos < self.prompt
        column = k_pos.clamp(max=self.prompt - 1)
        last_seen = self.last_seen.to(device)[:, column]  # [B, kv]
        pruned = (last_seen < KEPT) & in_prompt
        generated = (q_pos >= self.prompt)[None, :, None]  # [1, q, 1]
        hide = torch.where(generated, pruned[:, None, :], ((index > last_seen) & in_prompt)[:, None, :])
        mask = kwargs.get("attention_mask")
        if mask is None:
            valid = self.valid.to(device)[:, column] | ~in_prompt  # [B, kv]
            allowed = (k_pos[None, :] <= q_pos[:, None])[None] & valid[:, None, :]  # [B, q, kv]
            allowed &= ~hide
            allowed |= ~allowed.any(-1, keepdim=True) & (k_pos[None, :] == q_pos[:, None])[None]
            return allowed[:, None]
        if mask.ndim != 4 or mask.shape[-1] != kv_len:
            raise AssertionError(
                f"layer {index}: unexpected mask of shape {tuple(mask.shape)} for {kv_len} keys"
            )
        if mask.dtype == torch.bool:
            return mask & ~hide[:, None]
        return mask.masked_fill(hide[:, None], torch.finfo(mask.dtype).min)

    def kept_columns(self, index: int, seq: int) -> torch.Tensor:
        """[B, S''] the columns a linear layer ``index`` sees in a call on the first ``seq`` tokens (the
        prompt's kept ones, padding included, and every later token), each row left-padded with -1."""
        seen = torch.ones(self.last_seen.shape[0], seq, dtype=torch.bool)
        seen[:, : self.prompt] = self.last_seen >= index
        width = int(seen.sum(dim=1).max())
        out = torch.full((seen.shape[0], width), -1, dtype=torch.long)
        for row in range(seen.shape[0]):
            columns = seen[row].nonzero().flatten()
            out[row, width - columns.numel() :] = columns
        return out

    def before_linear(self, index: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs["hidden_states"]
        seq = hidden.shape[1]
        columns = self.kept_columns(index, seq).to(hidden.device)  # [B, S'']
        self.gathered[index] = columns
        take = columns.clamp(min=0)
        gathered = hidden.gather(1, take[..., None].expand(-1, -1, hidden.shape[-1]))
        real = torch.ones(hidden.shape[0], seq, dtype=torch.bool)
        real[:, : self.prompt] = self.valid
        valid = (columns >= 0) & real.to(hidden.device).gather(1, take)
        gathered = gathered * valid[..., None].to(gathered.dtype)
        if args:
            args = (gathered, *args[1:])
        else:
            kwargs["hidden_states"] = gathered
        all_valid = bool(valid.all())
        kwargs["attention_mask"] = None if all_valid else valid.long()
        return args, kwargs

    def after_linear(self, index: int, inputs: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        columns = self.gathered.pop(index)
        out = inputs.clone()
        rows, slots = (columns >= 0).nonzero(as_tuple=True)
        out[rows, columns[rows, slots]] = output[rows, slots]
        return out


def _kv_sources(text_config: Any, kinds: list[str]) -> dict[int, int]:
    """Layer -> the layer whose keys and values it reads, for the last ``num_kv_shared_layers`` layers
    (Gemma 4): the last earlier layer of its type."""
    shared = getattr(text_config, "num_kv_shared_layers", 0) or 0
    first = len(kinds) - shared
    return {
        index: max(i for i in range(first) if kinds[i] == kinds[index]) for index in range(first, len(kinds))
    }


@contextmanager
def pruned_reference(
    model: nn.Module,
    stages: Sequence[tuple[int, torch.Tensor]],
    attention_mask_2d: torch.Tensor | None = None,
) -> Iterator[None]:
    """Make ``model`` compute what physical pruning claims: each ``(L, pruned [B, S] bool)`` stage removes
    its ``pruned`` prompt columns after decoder layer ``L``. Works for a plain forward and for
    ``generate()`` (dynamic or static cache); hooks are removed on exit."""
    stages = list(stages)
    padding = (
        attention_mask_2d
        if attention_mask_2d is not None
        else torch.ones_like(stages[0][1], dtype=torch.long)
    )
    state = _Reference(model, stages, padding)
    decoder = _decoder(model)
    inputs: dict[int, torch.Tensor] = {}

    def before(module: nn.Module, args: tuple, kwargs: dict, index: int) -> tuple[tuple, dict]:
        hidden = args[0] if args else kwargs["hidden_states"]
        if state.kind(index) in LINEAR_KINDS:
            if state.prefill and bool((state.last_seen < index).any()):
                inputs[index] = hidden
                return state.before_linear(index, args, kwargs)
            return args, kwargs
        kwargs["attention_mask"] = state.attention_mask(index, kwargs, hidden)
        return args, kwargs

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any, index: int) -> Any:
        if index not in inputs:
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        restored = state.after_linear(index, inputs.pop(index), hidden)
        return (restored, *output[1:]) if isinstance(output, tuple) else restored

    handles = [decoder.register_forward_pre_hook(state.on_decoder_call, with_kwargs=True)]
    for index, layer in enumerate(decoder.layers):
        handles.append(
            layer.register_forward_pre_hook(lambda m, a, k, i=index: before(m, a, k, i), with_kwargs=True)
        )
        handles.append(
            layer.register_forward_hook(lambda m, a, k, o, i=index: after(m, a, k, o, i), with_kwargs=True)
        )
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
