"""Evidence gathering: what a selector sees at one stage (``StageInputs``), from the model's own tensors.

Attention at a scored layer is recomputed for the few rows PriorTR needs (paper Appendix A.3): the
layer's query and key projections are captured as the layer runs, RoPE is applied as the layer applies
it, and only the text rows from the earliest separator on are pushed through a softmax with the causal
and padding masks applied explicitly (``priortr.probe``). Out of those rows each pool takes its prior Q
(its item's separator row), the rows averaged into its posterior P and the last prompt token's row.
Methods ranked by the vision tower read its [CLS] attention, captured when the tower ran. Methods that
weigh the prompt's text against the image at the input (SparseVLM's raters) read the hidden states that
entered decoder layer 0, captured as it ran.

Pools with the same size and budget at a stage form one ``Group``: one selector call ranks them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from priortr.adapters import FamilyAdapter
from priortr.adapters.base import VisionProbe
from priortr.checks import value_checks
from priortr.engine.config import PruningConfig
from priortr.engine.plan import PoolRows, PrefillPlan
from priortr.engine.sequence import SequenceMap
from priortr.host import to_device
from priortr.pools import Pool
from priortr.probe import RowSpec, apply_rope, attention_rows, cls_attention
from priortr.scoring import aggregate_heads, build_evidence
from priortr.selection import StageInputs
from priortr.surgery import gather_sequence


@dataclass
class Group:
    """Pools ranked by one selector call: G pools of n surviving tokens, each keeping ``budget``.

    ``rows`` [G] are their batch rows (``row_list`` on the host); ``positions``, ``item_of``,
    ``offset`` and ``columns`` [G, n] are each token's absolute position, item, index within its item,
    and current column.
    """

    pools: list[Pool]
    indices: list[int]
    budget: int
    row_list: list[int]
    rows: torch.Tensor
    positions: torch.Tensor
    item_of: torch.Tensor
    offset: torch.Tensor
    columns: torch.Tensor

    @property
    def size(self) -> int:
        return self.positions.shape[1]


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack``, as a free view when there is one tensor."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


def groups(plan: PrefillPlan, sequence: SequenceMap, layer: int, by_input_size: bool = False) -> list[Group]:
    """The pools that stage ``layer`` ranks, grouped by (size, budget), and by their size at the input
    too when ``by_input_size`` (methods that read every input token of an image)."""
    by_key: dict[tuple[int, int, int], list[int]] = {}
    for index, pool in enumerate(plan.pools):
        if layer in pool.stages:
            input_size = sum(item.size for item in pool.items) if by_input_size else 0
            by_key.setdefault((pool.size, min(pool.stages[layer], pool.size), input_size), []).append(index)
    out = []
    for (_, budget, _), indices in by_key.items():
        pools = [plan.pools[i] for i in indices]
        rows = [pool.row for pool in pools]
        row_index = sequence.row_index(rows)  # [G]
        positions = _stack([pool.positions for pool in pools])  # [G, n]
        out.append(
            Group(
                pools=pools,
                indices=indices,
                budget=budget,
                row_list=rows,
                rows=row_index,
                positions=positions,
                item_of=_stack([pool.item_of for pool in pools]),
                offset=_stack([pool.offset for pool in pools]),
                columns=sequence.columns(row_index, positions),
            )
        )
    return out


def stage_inputs(
    group: Group,
    hidden: torch.Tensor,
    attention: torch.Tensor | None,
    plan: PrefillPlan,
    config: PruningConfig,
    vision: dict[str, torch.Tensor] | None,
    embeddings: dict[str, torch.Tensor] | None = None,
) -> StageInputs:
    """Everything the method asks for about ``group``'s tokens: hidden states [G, n, D], attention
    evidence (``attention`` [B, H, R, S'] from ``attention_at_layer``), the vision tower's [CLS] row,
    the input embeddings (``input_embeddings``)."""
    visual_hidden = hidden[group.rows[:, None], group.columns]  # [G, n, D]
    fields: dict[str, Any] = {}
    if attention is not None:
        fields.update(group_attention(attention, group, [plan.pool_rows[i] for i in group.indices], config))
    if vision is not None:
        fields.update(vision)
    if embeddings is not None:
        fields.update(embeddings)
    return StageInputs(budget=group.budget, hidden=visual_hidden, seed=config.seed, **fields)


def attention_at_layer(
    plan: PrefillPlan, sequence: SequenceMap, captured: dict[str, Any], adapter: FamilyAdapter
) -> torch.Tensor:
    """Attention [B, H, R, S'] of every batch row's recomputed text rows (``plan.rows``) over the current
    sequence at the scored layer, from its captured projections and RoPE."""
    module = captured["attention"]
    queries, keys = adapter.queries_and_keys(module, captured["q"], captured["k"])
    rows = sequence.columns_of_rows(plan.rows)  # [B, R]
    cos, sin = captured["rope"]
    picked = queries.gather(
        2, rows[:, None, :, None].expand(-1, queries.shape[1], -1, queries.shape[-1]).to(queries.device)
    )
    picked = apply_rope(picked, gather_sequence(cos, rows), gather_sequence(sin, rows))  # [B, H, R, d]
    keys = apply_rope(keys, cos, sin)  # [B, Hkv, S', d]
    return attention_rows(picked, keys, RowSpec(rows, sequence.key_valid()), module.scaling)


def group_attention(
    attention: torch.Tensor, group: Group, pool_rows: list[PoolRows], config: PruningConfig
) -> dict[str, Any]:
    """The ``StageInputs`` attention fields of a group: Q, P and the last row, normalised
    (``scoring.build_evidence``), and the instruction rows for methods that weigh them one by one."""
    every_row = group.row_list == list(range(attention.shape[0]))
    per_pool = attention if every_row else attention.index_select(0, group.rows)  # [G, H, R, S']
    heads, n_rows = per_pool.shape[1], per_pool.shape[2]
    size = group.size
    device = per_pool.device
    columns = group.columns.to(device)[:, None, None, :]
    visual = per_pool.gather(3, columns.expand(-1, heads, n_rows, -1))  # [G, H, R, n]
    items = max(rows.prior.numel() for rows in pool_rows)
    separator_rows = torch.zeros(len(pool_rows), items, dtype=torch.long)  # [G, I] each item's prior row
    for g, rows in enumerate(pool_rows):
        separator_rows[g, : rows.prior.numel()] = rows.prior
    prior_rows = to_device(separator_rows, device).gather(1, group.item_of.to(device))  # [G, n]
    prior = visual.gather(2, prior_rows[:, None, None, :].expand(-1, heads, 1, -1)).squeeze(2)  # [G, H, n]
    for g, pool in enumerate(group.pools):
        if len(pool.items) > 1:
            prior[g] = per_item_prior(prior[g], group.item_of[g].to(device), len(pool.items))
    last = to_device(torch.tensor([rows.last for rows in pool_rows]), device)
    last_row = visual.gather(2, last[:, None, None, None].expand(-1, heads, 1, size)).squeeze(2)  # [G, H, n]
    valid = to_device(_stack([rows.posterior for rows in pool_rows]), device)  # [G, R]
    fields: dict[str, Any] = {
        "attention": build_evidence(prior, visual, valid, last_row, heads=config.heads, seed=config.seed),
        "text_valid": valid,
    }
    if "text_rows" in config.method.needs:
        fields["text_rows"] = aggregate_heads(visual.transpose(1, 2).float(), config.heads)  # [G, R, n]
    return fields


def per_item_prior(prior: torch.Tensor, item_of: torch.Tensor, n_items: int) -> torch.Tensor:
    """``prior`` [H, n] L1-normalised within each item, times the item's share of the n tokens.

    With several items in one pool (``multi_image='global'``) each token's prior comes from its own
    item's separator, which sees that item only, so raw rows of different separators are not
    comparable; the posterior rows follow the pool's last separator and see every item.
    """
    one_hot = torch.nn.functional.one_hot(item_of, n_items).to(prior.dtype)  # [n, I]
    mass = prior @ one_hot  # [H, I]
    share = one_hot.sum(dim=0) / item_of.numel()  # [I]
    if value_checks() and bool((mass <= 0).any()):
        raise ValueError(
            "an item's separator row puts no attention on its tokens; cannot normalise its prior"
        )
    return prior / mass[:, item_of] * share[item_of]


def vision_evidence(
    capture: dict[str, torch.Tensor], probe: VisionProbe, plan: PrefillPlan, group: Group, method: str
) -> dict[str, torch.Tensor]:
    """The vision tower's [CLS] attention and keys over each of the group's tokens, captured when it ran;
    the tower encodes the batch's images in prompt order, one image per item."""
    if "q" not in capture or "k" not in capture:
        raise ValueError(
            f"method {method!r} needs the vision tower's attention, but the tower did not run for this "
            "prompt; pass pixel_values (not precomputed image features)"
        )
    cls, keys = cls_attention(capture["q"], capture["k"], probe.heads, probe.scaling, probe.first_token)
    images = [item for pool in plan.pools for item in pool.items]
    if any(item.modality != "image" for item in images) or len(images) != cls.shape[0]:
        raise ValueError(
            f"the vision tower saw {cls.shape[0]} images but the prompts hold {len(images)} visual "
            "items; [CLS]-ranked methods need one tower image per prompt image"
        )
    if max(item.size for item in images) > cls.shape[1]:
        raise ValueError(
            f"the vision tower gave {cls.shape[1]} tokens per image but an image has more visual "
            "tokens in the prompt; use the processor's image size"
        )
    slot = {id(item): index for index, item in enumerate(images)}
    image_of = torch.zeros(len(group.pools), max(len(pool.items) for pool in group.pools), dtype=torch.long)
    for g, pool in enumerate(group.pools):
        image_of[g, : len(pool.items)] = torch.tensor([slot[id(item)] for item in pool.items])
    image = to_device(image_of, cls.device)  # [G, I] tower image of each item
    image = image.gather(1, group.item_of.to(cls.device))  # [G, n] tower image of each token
    offset = group.offset.to(cls.device)
    return {
        "vision_cls": cls[image, offset],  # [G, n]
        "vision_keys": keys[image, :, offset].permute(0, 2, 1, 3),  # [G, H, n, d]
    }


def input_embeddings(
    embeddings: torch.Tensor | None, input_positions: list[torch.Tensor], plan: PrefillPlan, group: Group
) -> dict[str, torch.Tensor]:
    """The group's text rows and input visual tokens as they entered decoder layer 0 (``embeddings``
    [B, S, D], captured there); ``input_positions`` are every pool's positions before any stage."""
    if embeddings is None:
        raise ValueError(
            "the input embeddings were not captured: the language model's first decoder layer did not run "
            "in this prefill"
        )
    rows = group.rows.to(embeddings.device)  # [G]
    text = plan.rows.to(embeddings.device).index_select(0, rows)  # [G, R] absolute positions
    visual = _stack([input_positions[i] for i in group.indices]).to(embeddings.device)  # [G, N0]
    after = _stack([plan.pool_rows[i].after_image for i in group.indices])  # [G, R] host
    return {
        "text_embeddings": embeddings[rows[:, None], text],  # [G, R, D]
        "text_after_image": to_device(after, embeddings.device),
        "visual_embeddings": embeddings[rows[:, None], visual],  # [G, N0, D]
    }
