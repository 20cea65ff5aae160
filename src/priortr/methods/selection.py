"""What a pruning stage sees, and what it decides: the contract between the engine and every method.

The engine (``priortr.engine``) gathers the evidence a method asks for at one pruning stage into a
:class:`StageInputs` (all tensors batch first, over the stage's N visual tokens of each image) and
calls the method's selector, a pure tensor function returning a :class:`Selection`. Selectors never
see the model, the cache or positions; the engine alone applies the decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from priortr.methods.scoring import Evidence, select_top_k
from priortr.methods.value_checks import value_checks

MERGE_SPACES = ("hidden", "features")


@dataclass(frozen=True)
class StageInputs:
    """Evidence available to a selector at one stage, for B images of N visual tokens each.

    Attributes:
        budget: K, visual tokens per image that survive the stage (merged representatives included).
        hidden: [B, N, D] the visual tokens' hidden states at the stage: the language model's input
            embeddings for a stage before the LLM, the output of the scoring layer otherwise.
        attention: prior Q, posterior P and the last prompt token's row, L1-normalised over the visual
            tokens (``scoring.build_evidence``); None when the method does not ask for attention.
        text_rows: [B, R, N] float32 head-mean attention of the posterior's rows (``posterior_rows``:
            by default the separator and every prompt token after it) over the visual tokens, not
            normalised; rows where ``text_valid`` is False are padding and must be ignored.
        text_valid: [B, R] bool.
        text_embeddings: [B, R, D] the language model's input embeddings (the hidden states entering
            decoder layer 0) of the same R rows as ``text_rows``, in the model's dtype.
        visual_embeddings: [B, N0, D] the input embeddings of every visual token the image had before
            any stage (N0 >= N), in prompt order. These two (and ``text_after``) are gathered only for
            methods that declare ``input_embeddings`` (SparseVLM chooses its text raters from them).
        vision_cls: [B, N] float32 (float64 for a float64 tower) head-mean attention of the vision
            tower's [CLS] query over the visual tokens, at the vision layer whose output the model
            uses; None without a [CLS].
        vision_keys: [B, H, N, d] that vision layer's keys of the visual tokens.
        keys: [B, N, H_kv * d] the scored layer's keys of the visual tokens (after the family's k-norm
            and RoPE, every kv head side by side); ``text_keys`` [B, R, H_kv * d] those of the text rows
            (every prompt token from the earliest separator on; ``text_after`` [B, R] bool marks the
            image's own text, from its separator on, the rest is padding or another image's).
        prompt_positions: [B, N] int64 each visual token's index in its prompt, counted from the row's
            first non-padding token; ``text_prompt_positions`` [B, R] those of the text rows.
        normed: [B, N, D] the scored layer's output through the language model's final norm;
            ``text_normed`` [B, R, D] those of the text rows.
        vision_cls_last: [B, N] the [CLS] attention of the vision tower's last layer, one softmax over
            all heads concatenated (PruMerge's, ``probe.cls_attention_concatenated``).
        vision_keys_last: [B, N, C] that layer's keys, heads concatenated.
        vision_features: [B, N, C] the vision tower's features before the projector (the projector
            maps them to ``hidden`` at a stage before the LLM).
        grids: per image, its token grid (h, w) (N = h w, row-major) at the image's first stage, None
            at later stages (methods that declare ``grid``: CLSE's spectral term).
        seed: seed for any randomness (random baselines, K-means initialisation).
    """

    budget: int
    hidden: torch.Tensor
    attention: Evidence | None = None
    text_rows: torch.Tensor | None = None
    text_valid: torch.Tensor | None = None
    text_embeddings: torch.Tensor | None = None
    visual_embeddings: torch.Tensor | None = None
    vision_cls: torch.Tensor | None = None
    vision_keys: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    text_keys: torch.Tensor | None = None
    text_after: torch.Tensor | None = None
    prompt_positions: torch.Tensor | None = None
    text_prompt_positions: torch.Tensor | None = None
    normed: torch.Tensor | None = None
    text_normed: torch.Tensor | None = None
    vision_cls_last: torch.Tensor | None = None
    vision_keys_last: torch.Tensor | None = None
    vision_features: torch.Tensor | None = None
    grids: tuple[tuple[int, int] | None, ...] | None = None
    seed: int = 0

    @property
    def n_visual(self) -> int:
        return self.hidden.shape[1]


@dataclass(frozen=True)
class Selection:
    """A selector's decision for one stage.

    Attributes:
        indices: [B, K] int64 indices into the stage's N visual tokens, strictly ascending per row.
        merge: None for plain pruning (survivors keep their own hidden states), or float [B, K, N]
            with non-negative rows summing to 1: survivor k's hidden state becomes
            ``merge[b, k] @ hidden[b]`` (token merging). A survivor's KV-cache entries of earlier
            layers are its own; only the hidden state that later layers see is merged.
        merge_space: ``hidden`` (the rows average ``hidden``) or ``features`` (a stage before the
            LLM: the rows combine ``vision_features``, with any non-negative weights, as the authors
            of VisionZip and PruMerge merge before the projector, and the projector maps the result).
        scores: [B, N] float32 the scores the selector ranked by, when it ranks by one score
            (reported in ``handle.last`` and drawn by ``priortr viz``); None otherwise.
    """

    indices: torch.Tensor
    merge: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    merge_space: str = "hidden"

    def __post_init__(self) -> None:
        """Reject a decision the engine could not apply consistently."""
        kept = self.indices
        if kept.ndim != 2 or kept.dtype != torch.int64:
            raise ValueError(f"Selection.indices must be int64 [B, K], got {kept.dtype} {tuple(kept.shape)}")
        merge = self.merge
        if merge is not None and (merge.ndim != 3 or tuple(merge.shape[:2]) != tuple(kept.shape)):
            raise ValueError(
                f"Selection.merge must be [B, K, N] with [B, K] = {tuple(kept.shape)}, "
                f"got {tuple(merge.shape)}"
            )
        if self.merge_space not in MERGE_SPACES:
            raise ValueError(f"Selection.merge_space must be one of {MERGE_SPACES}, got {self.merge_space!r}")
        if not value_checks():
            return
        if kept.shape[1] > 1 and not bool((kept[:, 1:] > kept[:, :-1]).all()):
            raise ValueError("Selection.indices must be strictly ascending in every row")
        if merge is not None:
            if bool((merge < 0).any()):
                raise ValueError("Selection.merge rows must be non-negative")
            ones = torch.ones((), dtype=merge.dtype, device=merge.device)
            if self.merge_space == "hidden" and not torch.allclose(merge.sum(-1), ones, atol=1e-4):
                raise ValueError("Selection.merge rows must sum to 1 (merge_space='hidden')")


def top_k(scores: torch.Tensor, budget: int) -> Selection:
    """Plain pruning that keeps the ``budget`` highest ``scores`` [B, N] of each row."""
    return Selection(indices=select_top_k(scores, budget), scores=scores)


def keep_all(inputs: StageInputs) -> Selection:
    """Every visual token survives unchanged (a budget of at least N)."""
    batch, n_visual = inputs.hidden.shape[:2]
    kept = torch.arange(n_visual, device=inputs.hidden.device).expand(batch, n_visual)  # [B, N]
    return Selection(indices=kept.contiguous())
