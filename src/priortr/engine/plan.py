"""The plan of one pruned prefill, made on the host once, before the first decoder layer runs.

From one host copy of the prompt's token ids and padding mask, the plan finds every image and video of
every row (``adapter.visual_items``; an item's separator is the slot right after it, Appendix A.3),
groups their tokens into pools (``priortr.engine.pools``), fixes every stage's budget, and lays out the text
rows whose attention a scored layer recomputes. Every count and shape a stage needs is a Python value
here, so the stages issue their device work without reading anything back from the device.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from priortr import compat
from priortr.adapters import FamilyAdapter
from priortr.engine.config import PruningConfig, PruningSkippedWarning
from priortr.engine.pools import TENSOR_FIELDS, Pool, group_items, make_pools
from priortr.tensors.host import to_device_once, to_host

ROW_EVIDENCE = frozenset({"attention", "next_attention", "keys", "final_norm"})
"""Evidence that reads the text rows after a pool's separator, so the plan lays them out."""


@dataclass(frozen=True)
class PoolRows:
    """Where one pool's attention evidence sits among the recomputed rows (indices into R, host).

    ``prior`` [I]: the row of each item's separator (its tokens' prior Q); ``posterior`` [R]: the
    rows averaged into P (``PruningConfig.posterior_rows``); ``last``: the row of the prompt's last token
    (FastV's signal); ``after`` [R]: the rows from the pool's last separator on, i.e. the text after its
    items (DART's text pivots). ``last_index`` [1]: ``last`` as a tensor, set when the plan moves to the
    model's device (``plan_prefill``), so that a stage gathers the last row without making a tensor.
    """

    prior: torch.Tensor
    posterior: torch.Tensor
    last: int
    after: torch.Tensor
    last_index: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefillPlan:
    """Everything about one prefill that is known before the first stage, mostly as host values; made
    once, by ``plan_prefill``, and never changed (the stages' state is ``priortr.engine.stage.StageState``).

    ``pools`` are the visual tokens ranked together as the prompt holds them, before any stage;
    ``stages`` the scored layers, in order. ``text_positions`` [B, S] are the prompt's text positions as
    the model numbers them (from the position ids the call passed, else ``0 .. S-1``), ``next_position``
    [B] the one after the prompt; ``padded`` says whether any row is left-padded. ``window_start`` [B]
    (models with local windows) is the text position of each row's first real token: local windows count
    positions from it (transformers' chunked masks count a row's chunks from its first real token; a
    sliding window sees the same differences either way).

    ``visual`` and ``valid`` [B, S] (on the model's device) flag the visual tokens and the non-padding
    tokens; ``text_rows`` [B, R] are the absolute positions of the text rows whose attention is
    recomputed at a scored layer: every non-padding text token of the row from its earliest separator on
    (0 where a row has fewer; ``pool_rows`` say which entries are real). ``pool_rows`` align with ``pools``.
    """

    seq: int
    pools: tuple[Pool, ...]
    stages: tuple[int, ...]
    visual: torch.Tensor
    valid: torch.Tensor
    text_tokens: list[int]
    next_position: torch.Tensor
    text_positions: torch.Tensor
    padded: bool
    text_rows: torch.Tensor | None = None
    pool_rows: tuple[PoolRows, ...] | None = None
    window_start: torch.Tensor | None = None

    @property
    def window_positions(self) -> torch.Tensor:
        """[B, S] the positions local windows count: text positions from each row's first real token."""
        if self.window_start is None:
            return self.text_positions
        return self.text_positions - self.window_start[:, None]

    @property
    def window_next(self) -> torch.Tensor:
        """[B] the position local windows count for the token after the prompt."""
        if self.window_start is None:
            return self.next_position
        return self.next_position - self.window_start


def make_plan(
    adapter: FamilyAdapter,
    model: torch.nn.Module,
    config: PruningConfig,
    call: compat.calls.ModelCall,
    n_layers: int,
) -> PrefillPlan | None:
    """Plan the prefill of ``call`` (the multimodal model's arguments), or None when nothing is pruned."""
    input_ids = call.input_ids
    if input_ids is None:
        return skip_prefill(
            config, "the model was called with inputs_embeds only, so the image tokens cannot be found"
        )
    batch, seq = input_ids.shape
    valid = compat.masks.padding(call.attention_mask, batch, seq, input_ids.device)  # [B, S] bool
    text_positions = adapter.text_positions(model, call.position_ids)
    plan = plan_prefill(
        adapter, model.config, config, input_ids, valid, n_layers, text_positions, arguments=call.arguments
    )
    if plan is None:
        return skip_prefill(config, "the prompt has no image tokens")
    return plan


def plan_prefill(
    adapter: FamilyAdapter,
    model_config: object,
    config: PruningConfig,
    input_ids: torch.Tensor,
    valid: torch.Tensor,
    n_layers: int,
    text_positions: torch.Tensor | None = None,
    counts: Sequence[int] | None = None,
    device: torch.device | None = None,
    arguments: Mapping[str, Any] | None = None,
) -> PrefillPlan | None:
    """The plan of a prefill of ``input_ids`` with padding mask ``valid`` [B, S], or None when the prompt
    has no image tokens: every front end (``priortr.apply``'s hooks, the vLLM plug-in's step) makes its
    plan here, and only here. ``text_positions`` [B or 1, S] number the prompt (None: ``0 .. S-1``);
    ``counts`` and ``arguments`` as for ``plan_on_host``; ``device``: the model's (None: ``input_ids``')."""
    batch, seq = input_ids.shape
    device = input_ids.device if device is None else device
    host = plan_on_host(
        adapter, model_config, config, *to_host(input_ids, valid), n_layers, counts, arguments
    )
    if host is None:
        return None
    pools, visual, valid, text_rows, rows_of_pools = _on_device(host, valid, device)
    if text_positions is None:  # the model numbers the prompt 0 .. S-1, left padding included
        text_positions = torch.arange(seq, device=device).expand(batch, seq)
        next_position = torch.full((batch,), seq, device=device)
    else:
        text_positions = text_positions.expand(batch, seq)
        next_position = text_positions.amax(dim=-1) + 1
    window_start = None
    if any(compat.layers.windows(model_config.get_text_config())):
        window_start = text_positions.gather(1, valid.int().argmax(dim=1, keepdim=True))[:, 0]
    return PrefillPlan(
        seq=seq,
        pools=pools,
        stages=host.stages,
        visual=visual,
        valid=valid,
        text_tokens=host.text_tokens,
        next_position=next_position,
        text_positions=text_positions,
        padded=host.padded,
        text_rows=text_rows,
        pool_rows=rows_of_pools,
        window_start=window_start,
    )


def _on_device(
    host: HostPlan, valid: torch.Tensor, device: torch.device
) -> tuple[tuple[Pool, ...], torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[PoolRows, ...] | None]:
    """The host plan's tensors on ``device`` in one queued copy (``to_device_once``): pools, visual flags,
    padding mask (copied only when it is not there already), text rows and each pool's rows."""
    copy_valid = not _on(valid, torch.device(device))
    tensors = [host.visual, valid] if copy_valid else [host.visual]
    for pool in host.pools:
        tensors += [getattr(pool, name) for name in TENSOR_FIELDS]
    if host.text_rows is not None:
        tensors.append(host.text_rows)
    for rows in host.pool_rows or ():
        tensors += [rows.prior, rows.posterior, rows.after, torch.tensor([rows.last])]
    moved = iter(to_device_once(tensors, device))
    visual = next(moved)
    valid = next(moved) if copy_valid else valid
    pools = tuple(replace(pool, **{name: next(moved) for name in TENSOR_FIELDS}) for pool in host.pools)
    text_rows = None if host.text_rows is None else next(moved)
    rows_of_pools = None
    if host.pool_rows is not None:
        rows_of_pools = tuple(
            replace(rows, prior=next(moved), posterior=next(moved), after=next(moved), last_index=next(moved))
            for rows in host.pool_rows
        )
    return pools, visual, valid, text_rows, rows_of_pools


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` is on ``device`` (``cuda`` without an index: the current one)."""
    return tensor.device == device or (device.index is None and tensor.device.type == device.type)


@dataclass(frozen=True)
class HostPlan:
    """The part of a plan computed from the host copy of the prompt (see ``PrefillPlan``)."""

    pools: tuple[Pool, ...]
    stages: tuple[int, ...]
    visual: torch.Tensor
    text_tokens: list[int]
    padded: bool
    text_rows: torch.Tensor | None = None
    pool_rows: tuple[PoolRows, ...] | None = None


def plan_on_host(
    adapter: FamilyAdapter,
    model_config: object,
    config: PruningConfig,
    input_ids: torch.Tensor,
    valid: torch.Tensor,
    n_layers: int,
    counts: Sequence[int] | None = None,
    arguments: Mapping[str, Any] | None = None,
    read_grids: bool = True,
) -> HostPlan | None:
    """Images, pools, stages and attention rows from host copies of the prompt ``input_ids`` and its
    padding mask ``valid`` [B, S]; None when the prompt has no image tokens.

    ``counts`` fixes the tokens each pool keeps at ``config.stage_layer`` (one stage), in pool order, for a
    caller that laid out that many slots per image already (the vLLM plug-in's prompts); None plans
    them from ``config``'s budget. ``arguments`` are the model call's (its images' grids, for a method
    that reads them: ``adapter.item_grids``); ``read_grids=False`` leaves the grids unread, for a caller
    that only counts the tokens kept (``front_door.kept_runs``), which no grid changes."""
    items = adapter.visual_items(model_config, input_ids)
    if not items:
        return None
    if read_grids and "grid" in config.method.needs:
        items = adapter.item_grids(model_config, items, arguments or {})
    batch, seq = input_ids.shape
    visual = torch.zeros(batch, seq, dtype=torch.bool)
    for item in items:
        visual[item.row, item.positions] = True
    groups = group_items(items, config.multi_image)
    if counts is None:
        stages = [config.schedule(group.size, n_layers, group.part) for group in groups]
    else:
        stages = [[(config.stage_layer, count)] for count in counts]
    pools = make_pools(groups, stages, config.separator_offset)
    text_rows, rows_of_pools = None, None
    if config.method.needs & ROW_EVIDENCE:
        text_rows, rows_of_pools = _lay_out_rows(pools, visual, valid, config, adapter.separator_token)
    n_visual, n_valid = torch.stack([visual.sum(dim=1), valid.sum(dim=1)]).tolist()  # [B] each, one read
    return HostPlan(
        pools=tuple(pools),
        stages=tuple(sorted({layer for pool in pools for layer in pool.layers})),
        visual=visual,
        text_tokens=[seq - count for count in n_visual],
        padded=any(count < seq for count in n_valid),
        text_rows=text_rows,
        pool_rows=rows_of_pools,
    )


def skip_prefill(config: PruningConfig, reason: str) -> None:
    """Warn that a prefill runs unpruned (raise under ``strict``)."""
    if config.strict:
        raise ValueError(f"cannot prune: {reason} (strict=True)")
    warnings.warn(f"priortr: pruning skipped, {reason}", PruningSkippedWarning, stacklevel=6)
    return None


def _lay_out_rows(
    pools: list[Pool], visual: torch.Tensor, valid: torch.Tensor, config: PruningConfig, separator_token: str
) -> tuple[torch.Tensor, tuple[PoolRows, ...]]:
    """The recomputed text rows [B, R] of every batch row, and where each pool's evidence sits among them."""
    batch, seq = visual.shape
    first = [seq] * batch
    text = (valid & ~visual).tolist()  # [B][S] the real text tokens
    for pool in pools:
        _check_separators(pool, text[pool.row], config, separator_token)
        first[pool.row] = min(first[pool.row], *pool.separators)
    rows = [[p for p in range(first[b], seq) if text[b][p]] for b in range(batch)]
    width = max(1, *(len(row) for row in rows))
    text_rows = torch.zeros(batch, width, dtype=torch.long)
    for b, row in enumerate(rows):
        text_rows[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return text_rows, tuple(pool_rows(pool, rows[pool.row], width, config.posterior_rows) for pool in pools)


def pool_rows(pool: Pool, rows: list[int], width: int, posterior_rows: str) -> PoolRows:
    """One pool's prior, posterior and last rows among its batch row's recomputed rows ``rows``.

    The posterior's rows (``posterior_rows``, ``config.POSTERIOR_ROWS``), i_e being the pool's last
    separator and T - 1 the prompt's last token: ``from_separator`` i_e .. T-1 (the paper, Appendix A.3:
    "rows j >= i_e"), ``after_separator`` i_e+1 .. T-1, ``from_separator_except_last`` i_e .. T-2 (the
    authors' Qwen strategy), ``last`` T-1.
    """
    index = {position: r for r, position in enumerate(rows)}
    separator_row = torch.tensor([index[separator] for separator in pool.separators], dtype=torch.long)
    latest = max(pool.separators)
    if posterior_rows == "last":
        chosen = [rows[-1]]
    elif posterior_rows == "from_separator":
        chosen = [p for p in rows if p >= latest]
    elif posterior_rows == "from_separator_except_last":
        chosen = [p for p in rows[:-1] if p >= latest]
    else:
        chosen = [p for p in rows if p > latest]
    posterior = torch.zeros(width, dtype=torch.bool)
    posterior[[index[p] for p in chosen]] = True
    after = torch.zeros(width, dtype=torch.bool)
    after[[index[p] for p in rows if p >= latest]] = True
    return PoolRows(separator_row, posterior, len(rows) - 1, after)


def _check_separators(pool: Pool, text: list[bool], config: PruningConfig, separator_token: str) -> None:
    """Each item's prior slot must be a real text token (``text``: the pool's prompt row, True at its real
    text tokens), and an instruction must follow it: without one the posterior rows hold no row the
    prior does not (``posterior_rows='last'`` reads the last token whatever it is)."""
    seq = len(text)
    for separator in pool.separators:
        if separator >= seq:
            raise ValueError(
                f"an image ends the prompt: the separator slot ({separator_token}, offset "
                f"{config.separator_offset}) does not exist. Put the instruction after the image"
            )
        if not text[separator]:
            raise ValueError(
                "the separator slot after an image is a padding or visual token; check the attention "
                "mask and separator_offset"
            )
    if config.posterior_rows == "last":
        return
    after = sum(text[max(pool.separators) + 1 :])  # real text tokens after the pool's last separator
    if after == 0:
        raise ValueError(
            "no instruction token follows the separator, so there is no posterior to score with (P would "
            "be the prior Q, every score 0); put the question after the image, or use posterior_rows='last'"
        )
    if config.posterior_rows == "from_separator_except_last" and after == 1:
        raise ValueError(
            "posterior_rows='from_separator_except_last' averages the separator to the token before the "
            "last, and one token follows the separator: P would be the prior Q, every score 0; put the "
            "question after the image, or use posterior_rows='from_separator'"
        )
