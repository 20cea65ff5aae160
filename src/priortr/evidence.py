"""One pool's attention evidence (paper Appendix A.3) from the attention rows recomputed at a layer.

The engine recomputes, per batch row, the attention of the prompt's text rows from the earliest
separator on (``probe.attention_rows``); this module cuts out of them what one pool's ranking needs:
the prior Q (each token's own item's separator row), the rows averaged into the posterior P, and the
last prompt token's row (FastV). Pure tensor functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from priortr.pools import Pool


@dataclass(frozen=True)
class PoolAttention:
    """Raw attention over one pool's n tokens, heads kept: ``prior`` [H, n], ``rows`` [H, R, n] (every
    recomputed row), ``valid`` [R] (which rows form P), ``last`` [H, n]."""

    prior: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor
    last: torch.Tensor


def pool_attention(
    attention: torch.Tensor,
    row_positions: torch.Tensor,
    columns: torch.Tensor,
    pool: Pool,
    last_row: int,
    posterior_rows: str,
) -> PoolAttention:
    """Cut one pool's evidence out of its batch row's recomputed attention.

    Args:
        attention: [H, R, S'] attention of the recomputed rows over the current sequence.
        row_positions: [R] absolute prompt position of each recomputed row (-1: padding row).
        columns: [n] current columns of the pool's surviving tokens.
        pool: the pool; its tokens' separators must be among ``row_positions``.
        last_row: absolute position of the row's last prompt token.
        posterior_rows: ``after_separator``, ``from_separator`` or ``last`` (``PruningConfig``).

    With several items in a pool (``multi_image='global'``) each item's prior is normalised over its
    own tokens and weighted by its share of the pool: a separator sees its own image only, so raw rows
    of different separators are not comparable; the posterior rows follow the pool's last separator
    and see every item, so P is normalised over the whole pool.
    """
    visual = attention[:, :, columns]  # [H, R, n]
    heads, _, n = visual.shape
    separators = pool.token_separators().to(row_positions.device)  # [n]
    at_separator = row_positions[None, :] == separators[:, None]  # [n, R]
    if not bool(at_separator.any(dim=1).all()):
        raise ValueError("a separator slot is not among the recomputed rows; it must be a text token")
    separator_row = at_separator.int().argmax(dim=1)  # [n]
    prior = visual.gather(1, separator_row[None, None, :].expand(heads, 1, n)).squeeze(1)  # [H, n]
    if len(pool.items) > 1:
        prior = _per_item(prior, pool.item_of.to(prior.device), len(pool.items))
    latest = max(pool.separators)
    real = row_positions >= 0
    if posterior_rows == "last":
        valid = row_positions == last_row
    elif posterior_rows == "from_separator":
        valid = real & (row_positions >= latest)
    else:
        valid = real & (row_positions > latest)
    last = visual[:, int((row_positions == last_row).int().argmax())]  # [H, n]
    return PoolAttention(prior, visual, valid, last)


def _per_item(prior: torch.Tensor, item_of: torch.Tensor, n_items: int) -> torch.Tensor:
    """``prior`` [H, n] L1-normalised within each item, times the item's share of the n tokens."""
    one_hot = torch.nn.functional.one_hot(item_of, n_items).to(prior.dtype)  # [n, I]
    mass = prior @ one_hot  # [H, I]
    share = one_hot.sum(dim=0) / item_of.numel()  # [I]
    if bool((mass <= 0).any()):
        raise ValueError(
            "an item's separator row puts no attention on its tokens; cannot normalise its prior"
        )
    return prior / mass[:, item_of] * share[item_of]
