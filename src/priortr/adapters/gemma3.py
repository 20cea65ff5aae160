"""Gemma 3 (``Gemma3ForConditionalGeneration``): a SigLIP tower pooled to a fixed number of tokens per
image, and a text model of sliding-window and global attention layers (five to one in the released
models, window 512-1024) with a hybrid cache.

* An image is ``<start_of_image> <image_soft_token> x mm_tokens_per_image <end_of_image>``
  (``Gemma3Processor``, with ``\\n\\n`` around it); its separator is ``<end_of_image>``. The processor
  returns ``token_type_ids`` (1 on image tokens), with which the model lets the tokens of one image attend
  to each other in both directions at prefill; the text rows PriorTR recomputes all follow the image, so
  for them this is the causal mask.
* Attention applies ``q_norm`` / ``k_norm`` per head before RoPE and scales by ``query_pre_attn_scalar **
  -0.5`` (the module's ``scaling``); sliding and global layers receive their own ``(cos, sin)`` (two RoPE
  bases), which each layer's call carries. Attention-logit soft-capping (Gemma 2) is refused.
* Position ids are plain ``[B, S]`` text positions (the base class's handling).
"""

import torch
from torch import nn

from priortr.adapters.base import FamilyAdapter


class Gemma3Adapter(FamilyAdapter):
    name = "gemma3"
    model_types = ("gemma3",)
    separator_token = "<end_of_image>"
    no_grid = (
        "its tower pools an image to a square grid of mm_tokens_per_image tokens, which this adapter does "
        "not hand to the engine yet"
    )

    def queries_and_keys(
        self, attention: nn.Module, query_out: torch.Tensor, key_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head ``q_norm(q)`` [B, H, S, d] and ``k_norm(k)`` [B, H_kv, S, d], as ``Gemma3Attention``."""
        if getattr(attention, "attn_logit_softcapping", None) is not None:
            raise ValueError(
                "this Gemma model soft-caps its attention logits (attn_logit_softcapping), which priortr "
                "does not recompute; use a method that reads no attention (divprune, random)"
            )
        queries, keys = super().queries_and_keys(attention, query_out, key_out)
        return attention.q_norm(queries), attention.k_norm(keys)
