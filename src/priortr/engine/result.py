"""The report of a pruned prefill (``handle.last``), assembled when it is read, not during the prefill.

The prefill only keeps references to what it decided (each stage's surviving positions per pool, the
first stage's evidence); turning them into batch-shaped tensors costs device work that a serving loop
never asks for, so it happens on first access.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from priortr.engine.pools import Pool
from priortr.engine.sequence import SequenceMap
from priortr.methods.scoring import Evidence


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
class LayerCache:
    """What one decoder layer's cache holds of the prompt after the prefill, per batch row, as a dynamic
    cache holds it: ``kind`` ``keys`` (full attention: one entry per token), ``window`` (sliding or
    chunked attention: the window's last ``size - 1`` tokens), ``state`` (linear attention: a fixed-size
    state, no entries, left as it is) or ``shared`` (KV sharing: no entries, the layer reads an earlier
    layer's); ``unpruned`` entries without pruning and ``pruned`` with it."""

    kind: str
    unpruned: int
    pruned: int

    @classmethod
    def of(cls, kind: str, window: Any, prompt: int, kept: int) -> LayerCache:
        if kind in ("state", "shared"):
            return cls(kind, 0, 0)
        if kind == "window":
            return cls(kind, min(prompt, window.size - 1), min(kept, window.size - 1))
        return cls(kind, prompt, kept)


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
            batches); they lead their row (before its left padding), are masked from every query and
            their logits are meaningless.
        pruned: False when the budget covers every visual token (nothing was removed).
        stages: every stage in order.
        cache: every decoder layer's cache entries of the prompt, without and with pruning
            (``LayerCache``): which caches shrink (full attention's, local windows' while the prompt is
            longer than the window) and which do not (linear attention's states).
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
    cache: tuple[LayerCache, ...] = ()


@dataclass
class Scored:
    """A group's first-stage evidence and scores, with each pool's (row, positions) as they were ranked."""

    pools: list[tuple[int, torch.Tensor]]
    evidence: Evidence
    scores: torch.Tensor


@dataclass
class PrefillRecord:
    """What a prefill decided, as references: enough to build a ``PruneResult`` later."""

    visual: torch.Tensor  # [B, S] bool
    stages: list[tuple[int, list[tuple[int, torch.Tensor]], bool]]  # layer, (row, positions) per pool, merged
    scored: list[Scored]
    sequence: SequenceMap | None = None
    pruned: bool = False
    cache: tuple[LayerCache, ...] = ()
    peaks: list[torch.Tensor] = field(default_factory=list)  # per ranked group: [G] largest abs score

    def note_scores(self, pools: list[Pool], evidence: Evidence | None, scores: torch.Tensor | None) -> None:
        """Keep the first stage's ``evidence`` and ``scores`` [G, n] of ``pools`` (when it has both), and for
        for every stage each image's largest absolute score, NaN where a score is NaN, 0 where all are zero
        (device work, two ops: nothing is read back)."""
        if scores is not None:
            self.peaks.append(scores.abs().amax(dim=-1))
        if not self.stages and evidence is not None and scores is not None:
            self.scored.append(Scored([(pool.row, pool.positions) for pool in pools], evidence, scores))

    def add_stage(self, layer: int, pools: list[Pool], merged: bool) -> None:
        """Keep what survived the stage scored at ``layer``: every pool's (row, positions)."""
        self.stages.append((layer, [(pool.row, pool.positions) for pool in pools], merged))

    def has_degenerate_scores(self) -> bool:
        """Whether a stage ranked an image on NaN or all-zero scores. Reads the device: call it only once
        the model has returned (``PruningEngine`` does, after generate() or when ``last`` is read)."""
        return bool(self.peaks) and not bool((torch.cat(self.peaks) > 0).all())

    def result(self) -> PruneResult:
        visual = self.visual
        batch, seq = visual.shape
        survivors = [_survivors(batch, pools, visual) for _, pools, _ in self.stages]
        kept = survivors[-1] if survivors else _all_visual(visual)
        prior = posterior = scores = None
        if self.scored:
            names = ("prior", "posterior", "scores")
            published = {name: torch.full((batch, seq), float("nan"), device=visual.device) for name in names}
            for scored in self.scored:
                values = {
                    "prior": scored.evidence.prior,
                    "posterior": scored.evidence.posterior,
                    "scores": scored.scores,
                }
                for g, (row, positions) in enumerate(scored.pools):
                    for name, tensor in values.items():
                        published[name][row, positions] = tensor[g].float().to(visual.device)
            prior, posterior, scores = (
                _pad_rows([published[name][row][visual[row]] for row in range(batch)], float("nan"))
                for name in names
            )
        sequence = self.sequence
        positions = torch.arange(seq, device=visual.device).expand(batch, seq)
        padding = torch.zeros(batch, seq, dtype=torch.bool, device=visual.device)
        if sequence is not None and sequence.positions is not None:
            positions = sequence.positions
            padding = (
                sequence.filler if sequence.filler is not None else torch.zeros_like(positions, dtype=bool)
            )
        return PruneResult(
            kept=kept,
            n_visual=visual.sum(dim=1),
            prior=prior,
            posterior=posterior,
            scores=scores,
            visual_start=visual.int().argmax(dim=1),
            positions=positions,
            padding=padding,
            pruned=self.pruned,
            stages=tuple(
                StageResult(layer, rows, merged)
                for (layer, _, merged), rows in zip(self.stages, survivors, strict=True)
            ),
            cache=self.cache,
        )


def _survivors(batch: int, pools: list[tuple[int, torch.Tensor]], visual: torch.Tensor) -> torch.Tensor:
    """[B, K] every row's surviving positions, ascending (pools come in prompt order), padded with -1."""
    rows: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    for row, positions in pools:
        rows[row].append(positions)
    empty = visual.new_zeros(0, dtype=torch.long)
    return _pad_rows([torch.cat(row) if row else empty for row in rows])


def _all_visual(visual: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(visual.shape[1], device=visual.device)
    return _pad_rows([positions[row] for row in visual])


def _pad_rows(rows: list[torch.Tensor], fill: float = -1) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into [B, max], padded with ``fill``."""
    width = max(row.numel() for row in rows)
    out = torch.full((len(rows), width), fill, dtype=rows[0].dtype, device=rows[0].device)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out
