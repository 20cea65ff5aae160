"""A call that carries a continuation after its prompt, run as the prefill of its prompt followed by the
continuation on the pruned cache.

What pruning means for such a call (generate() without a cache re-reads the prompt with every token
generated so far; assisted decoding verifies an assistant's candidates in the call that reads the
prompt; log-likelihood scoring appends each answer to its question): the kept set is decided by the
prompt (image and instruction) alone, and the continuation runs as cached decoding runs it, on the
kept tokens in every layer. A single forward pass cannot give that, since the continuation's first
layers would run before the kept set is known and see every visual token. So the call is split where
the prompt ends (``PruningHandle.prompt_ends``): its prompt runs as a pruned prefill into a cache, then,
from the prefill's return hook, the continuation runs on that cache like a chat turn (``ledger``), and
the two outputs are joined into the one the call asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from priortr import compat
from priortr.compat.calls import ModelCall


@dataclass
class Continuation:
    """The part of a call after its prompt (its tokens, on the prompt's cache), and whether the caller
    wanted the cache back (``use_cache``)."""

    call: ModelCall
    keep_cache: bool

    def run(self, module: nn.Module, prompt_output: Any) -> Any:
        """Run the continuation on the cache the prompt's prefill filled; the two outputs joined."""
        output = module(**self.call.arguments)
        keep = self.call.arguments.get("logits_to_keep", 0)
        return compat.calls.join_outputs(prompt_output, output, self.keep_cache, keep)


def split_call(call: ModelCall, end: int, model: nn.Module) -> tuple[ModelCall, Continuation]:
    """``call`` (the multimodal model's) as the call of its first ``end`` tokens, with a cache to
    prefill (the call's own, else a new one), and the ``Continuation`` of the rest."""
    for flag in ("output_hidden_states", "output_attentions"):
        if call.arguments.get(flag):
            raise ValueError(
                f"{flag}=True on a call that carries a continuation after its prompt: its prompt and its "
                "continuation run as two passes (so that the continuation sees only the kept tokens); call "
                "the prompt and then the continuation on its cache yourself to read them"
            )
    mask = call.attention_mask
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.ndim == 2):
        raise ValueError(
            "a call that carries a continuation after its prompt needs a 2D attention mask (or none): "
            "it is cut where the prompt ends"
        )
    cache = compat.cache.new(model) if call.cache is None else call.cache
    prompt, rest = call.split(end, cache)
    return prompt, Continuation(rest, keep_cache=call.arguments.get("use_cache") is not False)
