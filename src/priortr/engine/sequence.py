"""Which prompt tokens the current, shortened sequence holds.

Two index spaces meet in a pruned prefill: *positions* index the prompt as the caller passed it
(S of them, the RoPE phases and the report use them) and *columns* index the sequence the layers now
run on (S' <= S). ``SequenceMap`` holds the map between them, on the model's device. Kept tokens keep
their original RoPE phases because the (cos, sin) pairs and position ids are gathered
(``priortr.tensors.gathers``), never recomputed (paper Sec. 3.3, Algorithm 1, Phase 3; renumbering
positions is measurably not equivalent).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from priortr.engine.memo import memo


@dataclass(frozen=True)
class SequenceMap:
    """The current sequence of a prefill, as maps over its columns; a cut makes a new one (``after_cut``).

    Attributes:
        positions: [B, S'] the prompt position of each column (the rows of logits a plain forward
            returns); None until the first cut, when columns are positions.
        visual: [B, S'] True at visual tokens (kept ones and fillers).
        valid: [B, S'] False at padding.
        filler: [B, S'] True at pruned tokens kept only so that every row has one length (ragged
            batches; masked from every query), or None when no row needs one.
        prompt_length: S.
    """

    prompt_length: int
    positions: torch.Tensor | None
    visual: torch.Tensor
    valid: torch.Tensor
    filler: torch.Tensor | None

    @property
    def width(self) -> int:
        """S', the current sequence length."""
        return self.visual.shape[1]

    @classmethod
    def of_prompt(cls, visual: torch.Tensor, valid: torch.Tensor) -> SequenceMap:
        """The whole prompt [B, S], before any cut: columns are positions."""
        return cls(prompt_length=visual.shape[1], positions=None, visual=visual, valid=valid, filler=None)

    @memo
    def column_of(self) -> torch.Tensor:
        """[B, S] the column of every prompt position, -1 where it was dropped (made when first read)."""
        batch, seq = self.positions.shape[0], self.prompt_length
        columns = torch.arange(self.width, device=self.positions.device).expand_as(self.positions)
        out = torch.full((batch, seq), -1, dtype=torch.long, device=self.positions.device)
        return out.scatter(1, self.positions, columns)

    def columns(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[G, n] the columns of ``positions`` [G, n] of batch rows ``rows`` [G]."""
        if self.positions is None:
            return positions
        return self.column_of[rows[:, None], positions]

    def columns_of_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, R] the columns of per-row ``positions`` [B, R] (every batch row)."""
        if self.positions is None:
            return positions
        return self.column_of.gather(1, positions)

    def key_valid(self) -> torch.Tensor:
        """[B, S'] the columns a query may attend to: neither padding nor filler."""
        return self.valid if self.filler is None else self.valid & ~self.filler

    def after_cut(self, index: torch.Tensor, filler: torch.Tensor | None) -> SequenceMap:
        """The sequence of the columns ``index`` [B, S''] (fillers first, then the kept ones ascending);
        ``filler`` flags the new fillers among them."""
        return SequenceMap(
            prompt_length=self.prompt_length,
            positions=index if self.positions is None else self.positions.gather(1, index),
            visual=self.visual.gather(1, index),
            valid=self.valid.gather(1, index),
            filler=filler,
        )
