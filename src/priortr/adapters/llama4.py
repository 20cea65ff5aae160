"""Llama 4 (``Llama4ForConditionalGeneration``: Scout, Maverick): a tiled vision tower with pixel shuffle,
and a mixture-of-experts text model of chunked-attention layers with RoPE and global layers without it (NoPE,
one in four as released).

* The model is its own multimodal model: ``Llama4ForConditionalGeneration`` itself takes the prompt, the
  images and the cache, and holds ``vision_model``, ``multi_modal_projector`` and ``language_model`` (a
  ``Llama4ForCausalLM``, whose ``.model`` has the decoder layers and the final norm).
* ``Llama4Processor`` writes an image of ``rows x cols`` tiles as ``<|image_start|>``, the tiles row by row
  (``<|patch|> x n`` each, ``<|tile_x_separator|>`` between the tiles of a row, ``<|tile_y_separator|>``
  after each row), ``<|image|>``, the global view (``<|patch|> x n``) and ``<|image_end|>``. Only
  ``<|patch|>`` receives image features: an image's visual tokens are its ``<|patch|>`` positions (the
  separators and ``<|image|>`` are text, kept), one item with one budget; its separator, the prior's
  slot, is ``<|image_end|>``, the token right after its last visual token.
* RoPE arrives as one complex tensor ``freqs_cis`` [B or 1, S, d / 2] (a rotation of neighbouring pairs
  of each head's dimensions), gathered, applied and inverted as such; kept tokens keep their phases. The
  chunked layers apply an L2 norm to queries and keys after RoPE (``use_qk_norm``); it is applied before
  here, which is the same since a RoPE rotation of modulus one keeps each vector's norm.
* A NoPE layer multiplies its queries by an attention temperature, ``1 + attn_scale * log1p(floor((i + 1)
  / floor_scale))``, where ``i`` is the query's index in the sequence the model ran on (its cache length
  plus its place in the call: padding included, position ids ignored). ``query_scales`` gives it; the
  engine hands it each kept token's index in the prompt, so after pruning the temperature is the one the
  unpruned model gives the same token (``docs/families.md``).
"""

import torch
from torch import nn

from priortr.adapters.base import FamilyAdapter, VisualItem, visual_runs
from priortr.tensors.gathers import gather_sequence

UNIT_ROPE_TYPES = ("default", "llama3", "linear", "dynamic")
"""RoPE types whose rotations have modulus one (transformers' ``attention_factor`` 1), with which the L2
q/k norm may come before RoPE."""


class Llama4Adapter(FamilyAdapter):
    name = "llama4"
    model_types = ("llama4",)
    separator_token = "<|image_end|>"
    no_grid = "an image is several tiles and a global view, each a grid of its own"

    def multimodal_model(self, model: nn.Module) -> nn.Module:
        return model

    def language_model(self, model: nn.Module) -> nn.Module:
        return model.language_model.model

    def vision_modules(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        return model.vision_model, model.multi_modal_projector

    def visual_items(self, config, input_ids: torch.Tensor) -> list[VisualItem]:
        """One item per image: the ``<|patch|>`` runs between an ``<|image_start|>`` and the
        ``<|image_end|>`` right after its last run."""
        start, end = config.boi_token_index, config.eoi_token_index
        items = []
        for row, runs in enumerate(visual_runs(input_ids, config.image_token_id)):
            ids = input_ids[row].tolist()
            group = []
            for first, last in runs:
                markers = [token for token in ids[:first] if token in (start, end)]
                if not group and (not markers or markers[-1] != start):
                    raise ValueError(
                        "an image's <|patch|> tokens do not follow an <|image_start|>; the prompt does not "
                        "follow the Llama 4 layout (use the model's processor)"
                    )
                group.append(torch.arange(first, last, device=input_ids.device))
                if last == len(ids) or ids[last] == end:
                    items.append(VisualItem(row, torch.cat(group), last))
                    group = []
            if group:
                raise ValueError(
                    "an image's <|patch|> tokens are not closed by <|image_end|>; the prompt does not follow "
                    "the Llama 4 layout (use the model's processor)"
                )
        return items

    def gather_rope(self, rope: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``freqs_cis`` [B or 1, S, d / 2] at the positions ``index`` [B, S']."""
        return gather_sequence(rope, index)

    def rotate(self, attention: nn.Module, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """``x`` [B, H, S, d] rotated by ``freqs_cis`` as ``apply_rotary_emb`` rotates it (in float32, pairs
        of neighbouring dimensions as complex numbers); unchanged in a NoPE layer."""
        if not attention.use_rope:
            return x
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * rope[:, None].to(pairs.device)).flatten(3).type_as(x)

    def inverse_rope(self, rope: torch.Tensor) -> torch.Tensor:
        return rope.reciprocal()

    def queries_and_keys(
        self, attention: nn.Module, query_out: torch.Tensor, key_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head queries [B, H, S, d] and keys [B, H_kv, S, d], L2-normed where the layer norms them."""
        queries, keys = super().queries_and_keys(attention, query_out, key_out)
        if not hasattr(attention, "qk_norm"):
            return queries, keys
        rope_type = attention.config.rope_parameters.get("rope_type", "default")
        if rope_type not in UNIT_ROPE_TYPES:
            raise ValueError(
                f"this Llama 4 model's RoPE ({rope_type!r}) scales its rotations, so its q/k norm after RoPE "
                "cannot be recomputed before it; use a method that reads no attention (divprune, random)"
            )
        return attention.qk_norm(queries), attention.qk_norm(keys)

    def scales_queries(self, attention: nn.Module) -> bool:
        return bool(attention.attn_temperature_tuning) and not attention.use_rope

    def query_scales(self, attention: nn.Module, index: torch.Tensor) -> torch.Tensor:
        """The temperature [B, S, 1] of queries at sequence index ``index`` [B, S] (``Llama4TextAttention``:
        arXiv 2501.19399), in float32 as the layer computes it."""
        floors = torch.floor((index.float() + 1.0) / attention.floor_scale)
        return (torch.log1p(floors) * attention.attn_scale + 1.0)[..., None]
