"""Masked reference ("oracle") for physical visual-token pruning, independent of ``priortr``.

Physical pruning at decoder layer ``L`` runs layers ``0..L`` on every token, then drops the pruned
tokens: layers ``> L`` only ever see the kept tokens, and the pruned tokens' keys/values are also
removed from the cache of layers ``0..L``, so generated tokens never attend to them in any layer.
Kept tokens keep their original RoPE positions.

The oracle reproduces exactly this without removing anything and without a KV cache: it runs the stock
model on the whole sequence at every call (``generate`` with ``use_cache=False``), with an attention
function of its own, registered through transformers' public ``AttentionInterface`` for the language
model only (softmax in the precision of the model's own implementation), that hides the pruned *key
columns*

* from prompt queries in layers ``> L``, and
* from generated queries (positions ``>= S_prompt``) in every layer.

Why that is equivalent on every kept position: attention is the only operation that mixes
positions (norms, MLPs and RoPE act per position, and RoPE uses each token's unchanged position
id), and softmax over a set of columns with some columns at ``-inf`` equals softmax over the
remaining columns. Hence, for every kept/text query, each layer's output is the same function of
the same kept inputs as in the physically pruned model, by induction over layers. The pruned
positions still compute (meaningless) hidden states after ``L``, but nobody reads them. Up to the
summation order of floating point, the logits of kept positions and the greedy tokens agree.

It shares nothing with ``priortr``'s knowledge of transformers' internals: no keyword names, no cache
layers, no masks built by transformers (every call sees the whole sequence, so query ``i`` and key
``j`` are absolute positions ``i`` and ``j``; a call that continues a cache is refused). A rename in
transformers therefore breaks the library's tests, not the reference they compare against.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

KEPT = 1 << 30
"""``last_seen`` of a column that is never pruned."""

ATTENTION = "priortr_masked_reference"


class _Masks:
    """The columns one reference run hides: ``last_seen`` [B, S_prompt] is the last decoder layer whose
    prompt queries see each prompt column (``KEPT`` if never pruned); ``valid`` [B, S_prompt] is False
    on padding. ``softmax_dtype``: the precision the model's own attention takes its softmax in (eager:
    float32 whatever the model's dtype), None for the scores' own."""

    def __init__(
        self, last_seen: torch.Tensor, valid: torch.Tensor, softmax_dtype: torch.dtype | None
    ) -> None:
        self.last_seen, self.valid, self.softmax_dtype = last_seen, valid, softmax_dtype

    def allowed(self, layer: int, seq: int, device: torch.device) -> torch.Tensor:
        """[B, seq, seq] bool: which key each query of decoder layer ``layer`` may attend to."""
        batch, prompt = self.last_seen.shape
        last_seen = torch.full((batch, seq), KEPT, dtype=torch.long)
        valid = torch.ones(batch, seq, dtype=torch.bool)
        last_seen[:, :prompt], valid[:, :prompt] = self.last_seen, self.valid
        last_seen, valid = last_seen.to(device), valid.to(device)
        position = torch.arange(seq, device=device)
        generated = (position >= prompt)[None, :, None]  # [1, q, 1]
        pruned = (last_seen < KEPT)[:, None, :]  # [B, 1, kv]
        hidden_now = (layer > last_seen)[:, None, :]  # [B, 1, kv]
        hide = torch.where(generated, pruned, hidden_now)  # [B, q, kv]
        allowed = (position[None, :] <= position[:, None])[None] & valid[:, None, :] & ~hide
        # Rows with nothing to attend to (padding queries) attend to themselves: their output is only
        # read by columns that are masked for every real query.
        empty = ~allowed.any(-1, keepdim=True)
        return allowed | (empty & torch.eye(seq, dtype=torch.bool, device=device)[None])


_ACTIVE: list[_Masks] = []


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``query`` [B, H, q, d] over ``key``/``value`` [B, H_kv, kv, d] under the active
    reference's mask (transformers' own mask is ignored); returns ([B, q, H, d], weights)."""
    if not _ACTIVE:
        raise RuntimeError("the masked reference's attention ran outside masked_reference()")
    if query.shape[2] != key.shape[2]:
        raise RuntimeError(
            "the masked reference runs every call on the whole sequence: call generate() or the model "
            "without a cache inside it (it sets use_cache=False for generate)"
        )
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("the masked reference does not model sliding-window attention")
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scale  # [B, H, q, kv]
    allowed = _ACTIVE[-1].allowed(module.layer_idx, query.shape[2], query.device)
    scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
    masks = _ACTIVE[-1]
    weights = torch.softmax(scores, dim=-1, dtype=masks.softmax_dtype).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


AttentionInterface.register(ATTENTION, _attention)


def masked_reference(
    model: nn.Module,
    layer: int,
    pruned: torch.BoolTensor,
    attention_mask_2d: torch.Tensor | None = None,
):
    """Make ``model`` behave as if the ``pruned`` prompt tokens were physically removed after ``layer``.

    Args:
        model: an HF multimodal model with a ``text_config``.
        layer: ``L``, the last decoder layer (0-indexed) that still sees every token; ``-1`` hides
            the pruned tokens from every layer, ``n_layers - 1`` only from generated tokens.
        pruned: [B, S_prompt] bool, True on prompt columns (absolute positions in the left-padded
            prompt) whose keys must be hidden. All-False gives back the stock model.
        attention_mask_2d: [B, S_prompt] prompt padding mask (1 = real token); None = no padding.

    Works for a plain forward and for ``generate()`` (run without a cache: the reference sets
    ``use_cache=False`` in the generation config, and refuses a call that continues a cache).
    """
    return staged_reference(model, [(layer, pruned)], attention_mask_2d)


@contextmanager
def staged_reference(
    model: nn.Module,
    stages: Sequence[tuple[int, torch.BoolTensor]],
    attention_mask_2d: torch.Tensor | None = None,
) -> Iterator[None]:
    """``masked_reference`` for pruning in stages: each (L, pruned) hides its ``pruned`` columns from
    prompt queries of layers after L (L = -1: from every layer), and from every generated query."""
    first = stages[0][1]
    last_seen = torch.full(first.shape, KEPT, dtype=torch.long)
    for layer, pruned in stages:
        assert pruned.shape == first.shape, (pruned.shape, first.shape)
        last_seen = torch.where(pruned.cpu() & (last_seen == KEPT), layer, last_seen)
    if attention_mask_2d is None:
        attention_mask_2d = torch.ones_like(first, dtype=torch.long)
    assert first.shape == attention_mask_2d.shape, (first.shape, attention_mask_2d.shape)
    text_implementation = model.config.get_text_config()._attn_implementation
    use_cache = model.generation_config.use_cache
    softmax_dtype = torch.float32 if text_implementation == "eager" else None
    _ACTIVE.append(_Masks(last_seen, attention_mask_2d.cpu().bool(), softmax_dtype))
    model.set_attn_implementation({"text_config": ATTENTION})
    model.generation_config.use_cache = False
    try:
        yield
    finally:
        model.generation_config.use_cache = use_cache
        model.set_attn_implementation({"text_config": text_implementation})
        _ACTIVE.pop()
