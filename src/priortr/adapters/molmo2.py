"""Molmo2 (``Molmo2ForConditionalGeneration``): a ViT whose patch features a cross-attention adapter pools
into tokens, and an OLMo / Qwen3-style decoder.

* An image is two views (``Molmo2Processor.replace_image_token``): its low-resolution global view, then its
  high-resolution crops, each a grid of ``<im_patch>`` rows, every row closed by ``<im_col>``::

      <low_res_im_start> (<im_patch> x w <im_col>) x h <im_end>
      <im_start> (<im_patch> x W <im_col>) x H <im_end>

  The visual tokens are the ``<im_patch>`` ones (``config.image_patch_id``), whose embeddings the pooled
  features are *added* to; the markers and ``<im_col>`` carry no image features and stay as text. The two
  views share one item (one budget), so ``visual_items`` groups the runs of one image: the runs after each
  view's opener (``<low_res_im_start>``, ``<im_start>``) form a view, and an image is a view pair (a
  processor with ``use_single_crop_start_token=False`` opens both with ``<im_start>``, so views are paired in
  order, low-resolution first). The separator is the token after the ``<im_end>`` that closes the
  image, the first token after it that is not an image token: the processor marks ``<im_col>`` and the
  markers as image tokens (``mm_token_type_ids`` 1), and with those types every image token's query
  attends to the whole image block, later tokens included, so a prior read at ``<im_col>`` or
  ``<im_end>`` would not be the causal row the engine recomputes (measured on the tiny model: the
  ``<im_col>`` after the last patch puts 4-5 % of its attention on the ``<im_end>`` after it, and its
  head-averaged prior then differs from the recomputed one by 2.5e-3). Rows of text after the image are
  causal, so its prior and posterior are exactly the model's own attention. Where the next image follows
  at once, the separator is that image's opener, and the posterior rows of an image include a later
  image's markers and columns: these rows are in the block, and the engine recomputes them causally.
* A video is frames of the low-resolution path only, each ``<frame_start> ... <frame_end>`` with the same
  ``<im_patch>`` id (``config.video_token_id`` is ``image_patch_id``); each frame is a video item, its
  separator the token after its ``<frame_end>``.
* With ``mm_token_type_ids`` (the processor returns them), every image token of a row (patches, columns
  and markers) is one bidirectional block at prefill (``Molmo2Model.forward``: ``block_sequence_ids``). The
  4-D mask the layers receive carries it, and the engine gathers it to the kept tokens.
* The special ids sit past the LM head's vocabulary (the embedding has ``additional_vocab_size`` more rows):
  nothing here reads the LM head.
* Attention: q/k RMSNorm per head (``qk_norm_type="qwen3"``) or over the whole projection (``"olmo"``),
  before RoPE; ``norm_after`` decoders normalise each sublayer's output, not its input. Position ids are
  plain ``[B, S]`` (the base class's handling).
"""

import torch
from torch import nn

from priortr.adapters.base import FamilyAdapter, VisionProbe, VisualItem, visual_runs


class Molmo2Adapter(FamilyAdapter):
    name = "molmo2"
    model_types = ("molmo2",)
    separator_token = "the token after the <im_end> that closes the image (its high-resolution view)"

    def visual_token_ids(self, config) -> dict[str, int]:
        return {"image": config.image_patch_id}

    def visual_items(self, config, input_ids: torch.Tensor) -> list[VisualItem]:
        """One item per image (both views) or video frame, separated by the token after its closer."""
        openers = {
            config.low_res_image_start_token_id: "low",
            config.image_start_token_id: "view",
            config.frame_start_token_id: "frame",
        }
        items = []
        for row, runs in enumerate(visual_runs(input_ids, config.image_patch_id)):
            ids = input_ids[row].tolist()
            views: list[tuple[str, list[tuple[int, int]]]] = []
            opened = -1
            for start, end in runs:
                opener = max((p for p in range(opened + 1, start) if ids[p] in openers), default=None)
                if opener is None and not views:
                    raise ValueError(
                        "an <im_patch> run has no view marker before it; the prompt does not follow the "
                        "Molmo2 layout (<low_res_im_start> or <im_start> or <frame_start> before each view)"
                    )
                if opener is not None:
                    views.append((openers[ids[opener]], []))
                    opened = opener
                views[-1][1].append((start, end))
            closers = {config.image_end_token_id, config.frame_end_token_id}
            items += self._items(row, views, ids, closers, input_ids.device)
        return items

    @staticmethod
    def _items(
        row: int,
        views: list[tuple[str, list[tuple[int, int]]]],
        ids: list[int],
        closers: set[int],
        device: torch.device,
    ) -> list[VisualItem]:
        """Row ``row``'s items from its views in order: image views in pairs (low-resolution, then
        high-resolution), a video frame alone. The separator is the token after the ``<im_end>``
        (``<frame_end>``) that closes the item's last view: the prompt's length where none does."""

        def item(runs: list[tuple[int, int]], modality: str) -> VisualItem:
            positions = torch.cat([torch.arange(start, end, device=device) for start, end in runs])
            closer = next((p for p in range(runs[-1][1], len(ids)) if ids[p] in closers), len(ids) - 1)
            return VisualItem(row, positions, closer + 1, modality)

        items, pending = [], None
        for kind, runs in views:
            if kind == "frame" and pending is None:
                items.append(item(runs, "video"))
            elif pending is None:
                pending = runs
            elif kind == "view":
                items.append(item(pending + runs, "image"))
                pending = None
            else:
                break
        if pending is not None:
            raise ValueError(
                "an image of this prompt has one view, not its low-resolution view followed by its "
                "high-resolution one; the prompt does not follow the Molmo2 layout"
            )
        return items

    def input_norm(self, layer: nn.Module) -> nn.Module:
        """The RMSNorm before attention; none in a ``norm_after`` decoder, which normalises the output."""
        return nn.Identity() if layer.norm_after else layer.input_layernorm

    def queries_and_keys(
        self, attention: nn.Module, query_out: torch.Tensor, key_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head queries [B, H, S, d] and keys [B, H_kv, S, d] normalised as ``Molmo2Attention`` does:
        over the whole projection (``olmo``) before the split into heads, or per head (``qwen3``)."""
        if attention.qk_norm_type == "olmo":
            query_out, key_out = attention.q_norm(query_out), attention.k_norm(key_out)
        queries, keys = super().queries_and_keys(attention, query_out, key_out)
        if attention.qk_norm_type == "qwen3":
            queries, keys = attention.q_norm(queries), attention.k_norm(keys)
        return queries, keys

    def vision_probe(self, model: nn.Module) -> VisionProbe | None:
        """None: the ViT has no [CLS] token, and each visual token pools a window of patches."""
        return None
