"""Evidence gathering: what a selector sees at one stage (``StageInputs``), from the model's own tensors.

``gather(needs, sources, group)`` assembles a group's ``StageInputs`` from small gatherers, one per kind
of evidence (``GATHERERS``): a new kind of evidence is one new gatherer and its entry there.

* attention (``attention``, ``next_attention``, with ``text_rows``): attention at a scored layer is
  recomputed for the few rows PriorTR needs (paper Appendix A.3) from the layer's query and key
  projections, captured as the layer ran (``ScoredLayer``), RoPE applied as the layer applies it, and
  only the text rows from the earliest separator on pushed through a softmax with the causal and padding
  masks applied explicitly (``priortr.engine.attention``). Out of those rows each pool takes its prior Q (its
  item's separator row), the rows averaged into its posterior P and the last prompt token's row.
* token features (``keys``, ``final_norm``): the scored layer's keys and its output through the final norm.
* vision evidence (``VISION_NEEDS``): the vision tower's [CLS] attention, keys and features, captured when
  the tower ran.
* input embeddings (``input_embeddings``): the hidden states that entered decoder layer 0 (SparseVLM's
  raters weigh the prompt's text against the image there).
* token grids (``grid``): each image's grid (h, w), from the plan's items (``adapter.item_grids``), at the
  image's first stage (CLSE's spectral term).

Pools with the same size and budget at a stage form one ``PoolGroup`` (``priortr.engine.stage.groups``):
one selector call ranks them all.
Nothing here edits what it reads: the queries and keys of the text rows a stage's groups share are
prepared once, when the first group reads them (``Sources.text_attention``).

Memory: the text rows' attention [B, H, R, S'] is never held whole. R grows with the prompt's text (a
long chat), so each group reduces it a chunk of rows at a time (``RowAttention.chunks``): the prior and
last rows picked out of the chunk that holds them, the posterior as a running sum over rows of each
row's head aggregate. A chunk holds r = max(1, ``ROW_CHUNK_ELEMENTS`` // (B H S')) rows, so its
[B, H, r, S'] attention and the few temporaries of one softmax stay within a bound set by B, H, S' and
the chunk, whatever R is (docs/how-it-works.md, "Memory"). A prompt whose rows fit one chunk is
computed by the same operations as one unchunked tensor, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from priortr.adapters import FamilyAdapter
from priortr.compat.layers import Window
from priortr.engine.attention import RowSpec, attention_rows, cls_attention, cls_attention_concatenated
from priortr.engine.config import BEFORE_LLM, VISION_NEEDS, PruningConfig
from priortr.engine.memo import memo
from priortr.engine.plan import PoolRows, PrefillPlan
from priortr.engine.pools import Pool
from priortr.engine.sequence import SequenceMap
from priortr.engine.state import StageState
from priortr.methods import MethodInfo
from priortr.methods.scoring import aggregate_heads, check_posterior_rows, reduced_evidence
from priortr.methods.value_checks import value_checks
from priortr.tensors.gathers import stack_views
from priortr.tensors.host import to_device


class TowerShape(Protocol):
    """What ``vision_evidence`` reads of a vision tower besides its captures: its attention heads, the
    softmax scale, the first of its tokens that is a visual token and its width. ``VisionProbe``
    (``priortr.apply``'s hooks) and the front door's ``TowerEvidence`` (the vLLM plug-in's captures)
    both have them."""

    heads: int
    scaling: float
    first_token: int
    width: int


ROW_CHUNK_ELEMENTS = 1 << 24
"""Attention elements of one chunk of text rows (``RowAttention.chunks``): 64 MiB in float32. A chunk
holds at least one row, so a single row's B * H * S' elements above this is the chunk instead."""


@dataclass(frozen=True)
class RowAttention:
    """The recomputed text rows of a stage, ready to be turned into attention a chunk of rows at a time.

    ``queries`` [B, h, R, d] and ``keys`` [B, h_kv, S', d] after RoPE (and any query scaling), the
    rows' ``spec`` (``spec.rows`` [B, R] their columns), the layer's softmax ``scaling``, ``heads`` the
    H heads a chunk has after ``gather`` (vLLM under tensor parallelism: this rank's h heads joined with
    every other rank's, ``decoder.LayerParts.every_head``; identity elsewhere, h = H).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    spec: RowSpec
    scaling: float
    heads: int
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def count(self) -> int:
        """R, the recomputed rows."""
        return self.queries.shape[2]

    def rows(self, chunk: slice) -> torch.Tensor:
        """Attention [B, H, r, S'] of the rows in ``chunk`` (a slice of the R rows)."""
        spec = self.spec
        part = RowSpec(spec.rows[:, chunk], spec.key_valid, spec.window, spec.positions)
        local = attention_rows(self.queries[:, :, chunk], self.keys, part, self.scaling)
        return local if self.gather is None else self.gather(local)

    def chunks(self, elements: int) -> list[slice]:
        """The R rows cut into consecutive chunks of at most max(1, ``elements`` // (B H S')) rows."""
        batch, seq = self.queries.shape[0], self.keys.shape[2]
        size = max(1, elements // max(1, batch * self.heads * seq))
        return [slice(start, min(start + size, self.count)) for start in range(0, self.count, size)]


@dataclass
class ScoredLayer:
    """What decoder layer ``index`` hands the stage that scores it (the stage runs before layer
    ``index + 1``): its attention module and RoPE (cos, sin) [B or 1, S', d], taken as the layer starts,
    and the outputs of its query and key projections [B, S', H * d], kept as they run (methods that read
    attention or keys only)."""

    index: int
    attention: torch.nn.Module
    rope: tuple[torch.Tensor, ...]
    query_out: torch.Tensor | None = None
    key_out: torch.Tensor | None = None


@dataclass(frozen=True)
class Sources:
    """Where one stage reads its evidence, for every group it ranks: the prefill's ``plan``, the
    ``state`` the stages before it left, and the model's tensors.

    ``hidden`` [B, S', D] enters the layer after the scored one (``next_layer``, whose prompt RoPE is
    ``rope``); ``window`` and ``next_window`` are the local windows of those two layers. ``embeddings``
    [B, S, D] entered decoder layer 0, when the method reads them. The recomputed text rows are
    prepared when a group first reads them (``text_attention``); a front end that ran the scored layer
    itself gives them instead (``priortr.engine.front_door``).
    """

    plan: PrefillPlan
    state: StageState
    config: PruningConfig
    hidden: torch.Tensor
    adapter: FamilyAdapter | None = None
    scored: ScoredLayer | None = None
    next_layer: torch.nn.Module | None = None
    rope: tuple[torch.Tensor, ...] | None = None
    window: Window | None = None
    next_window: Window | None = None
    vision: tuple[TowerShape, dict[str, torch.Tensor]] | None = None
    final_norm: torch.nn.Module | None = None
    embeddings: torch.Tensor | None = None

    @property
    def sequence(self) -> SequenceMap:
        """The current sequence, as the stages before this one left it."""
        return self.state.sequence

    @property
    def layer(self) -> int:
        """The layer the stage scores (-1: before the language model), as its scored layer tells."""
        return BEFORE_LLM if self.scored is None else self.scored.index

    @memo
    def text_attention(self) -> RowAttention:
        """The recomputed text rows at the scored layer (``attention``) or the layer after it
        (``next_attention``), prepared once for every group of the stage."""
        if "attention" in self.config.method.needs:
            return attention_at_layer(self)
        return next_layer_attention(self)


@dataclass(frozen=True)
class PoolGroup:
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


Gatherer = Callable[[Sources, PoolGroup], dict[str, Any]]
"""A function of one kind of evidence: the ``StageInputs`` fields it gives ``group``."""


def gather(needs: frozenset[str], sources: Sources, group: PoolGroup) -> dict[str, Any]:
    """The evidence fields of ``group``'s ``StageInputs``: its visual tokens' hidden states [G, n, D] and
    what each gatherer whose needs meet ``needs`` gives (the stage adds the budget)."""
    fields: dict[str, Any] = {"hidden": sources.hidden[group.rows[:, None], group.columns]}  # [G, n, D]
    for wanted, gatherer in GATHERERS.items():
        if needs & wanted:
            fields.update(gatherer(sources, group))
    return fields


def attention_fields(sources: Sources, group: PoolGroup) -> dict[str, Any]:
    """Q, P and the last row of the group's pools (``group_attention``), from the stage's recomputed
    text rows: at the scored layer (``attention``) or the layer after it (``next_attention``)."""
    pool_rows = [sources.plan.pool_rows[i] for i in group.indices]
    return group_attention(sources.text_attention, group, pool_rows, sources.config)


def token_fields(sources: Sources, group: PoolGroup) -> dict[str, torch.Tensor]:
    """Per-token features of the group's visual tokens and of the text rows (``plan.text_rows``) at the
    scored layer: its keys after the adapter's k-norm and RoPE, every kv head side by side (``keys``),
    and its output through the language model's final norm (``final_norm``), as DART reads them
    (``get_retained_image_token`` in the authors' ``modeling_llama_self.py``: ``any_states`` and
    ``self.norm(layer_outputs[0])``). Keys carry the RoPE phases and prompt positions count from each
    row's first real token, so a left-padded row gives what it gives alone."""
    plan, sequence, hidden = sources.plan, sources.sequence, sources.hidden
    needs = sources.config.method.needs
    device = hidden.device
    rows = group.rows.to(device)
    columns = group.columns.to(device)
    text_columns = sequence.columns_of_rows(plan.text_rows).to(device).index_select(0, rows)  # [G, R]
    fields: dict[str, torch.Tensor] = {"text_after": _text_after(plan, group, device)}
    if "keys" in needs:
        adapter, scored = sources.adapter, sources.scored
        start = plan.valid.int().argmax(dim=1)[:, None]  # [B, 1] each row's first real token
        module, rope = scored.attention, scored.rope
        _, keys = adapter.queries_and_keys(module, scored.query_out, scored.key_out)
        first = sequence.columns_of_rows(start)  # [B, 1]
        keys = adapter.rotate(module, keys, rope)  # [B, Hkv, S', d]
        # RoPE phases as if each row's first real token sat at position 0 (the authors' batch of one;
        # generate() numbers left-padded rows so already): rotate back by that token's own phase.
        keys = adapter.rotate(module, keys, adapter.inverse_rope(adapter.gather_rope(rope, first)))
        keys = keys.transpose(1, 2).flatten(2)  # [B, S', Hkv * d]
        fields["keys"] = keys[rows[:, None], columns]  # [G, n, Hkv * d]
        fields["text_keys"] = keys[rows[:, None], text_columns]  # [G, R, Hkv * d]
        start = start.index_select(0, rows)  # [G, 1]
        fields["prompt_positions"] = group.positions.to(device) - start  # [G, n]
        fields["text_prompt_positions"] = plan.text_rows.index_select(0, rows) - start  # [G, R]
    if "final_norm" in needs:
        fields["normed"] = sources.final_norm(hidden[rows[:, None], columns])  # [G, n, D]
        fields["text_normed"] = sources.final_norm(hidden[rows[:, None], text_columns])  # [G, R, D]
    return fields


def vision_fields(sources: Sources, group: PoolGroup) -> dict[str, torch.Tensor]:
    """What the tower showed of each of the group's tokens when it ran (``vision_evidence``)."""
    probe, capture = sources.vision
    return vision_evidence(capture, probe, sources.plan, group, sources.config.method)


def embedding_fields(sources: Sources, group: PoolGroup) -> dict[str, torch.Tensor]:
    """The group's text rows and input visual tokens as they entered decoder layer 0 (``embeddings``
    [B, S, D], captured there; the plan's pools hold every pool's positions before any stage)."""
    embeddings, plan = sources.embeddings, sources.plan
    if embeddings is None:
        raise ValueError(
            "the input embeddings were not captured: the language model's first decoder layer did not run "
            "in this prefill"
        )
    rows = group.rows.to(embeddings.device)  # [G]
    text = plan.text_rows.to(embeddings.device).index_select(0, rows)  # [G, R] absolute positions
    visual = stack_views([plan.pools[i].positions for i in group.indices]).to(embeddings.device)  # [G, N0]
    return {
        "text_embeddings": embeddings[rows[:, None], text],  # [G, R, D]
        "text_after": _text_after(plan, group, embeddings.device),
        "visual_embeddings": embeddings[rows[:, None], visual],  # [G, N0, D]
    }


def grid_fields(sources: Sources, group: PoolGroup) -> dict[str, Any]:
    """Each pool's image grid (h, w) at the pool's first stage, None at its later ones (``grids``): the
    grid a stage's cut has thinned out is no longer whole."""
    layer = sources.layer
    return {"grids": tuple(pool.items[0].grid if layer == pool.layers[0] else None for pool in group.pools)}


GATHERERS: dict[frozenset[str], Gatherer] = {
    frozenset({"attention", "next_attention"}): attention_fields,
    frozenset({"keys", "final_norm"}): token_fields,
    VISION_NEEDS: vision_fields,
    frozenset({"input_embeddings"}): embedding_fields,
    frozenset({"grid"}): grid_fields,
}
"""Each kind of evidence: the needs that ask for it, and its gatherer."""


def _text_after(plan: PrefillPlan, group: PoolGroup, device: torch.device) -> torch.Tensor:
    """[G, R] bool: the text rows from each pool's last separator on (the text after its items)."""
    return stack_views([plan.pool_rows[i].after for i in group.indices]).to(device)


def row_spec(plan: PrefillPlan, sequence: SequenceMap, rows: torch.Tensor, window: Window | None) -> RowSpec:
    """The keys each recomputed row ``rows`` [B, R] sees: causal, valid, and in the layer's ``window``
    (counted in the prompt's own positions, from each row's first real token)."""
    if window is None:
        return RowSpec(rows, sequence.key_valid())
    positions = plan.window_positions
    if sequence.positions is not None:
        positions = positions.gather(1, sequence.positions)
    return RowSpec(rows, sequence.key_valid(), window.visible, positions)


def attention_at_layer(sources: Sources) -> RowAttention:
    """Every batch row's recomputed text rows (``plan.text_rows``) over the current sequence at the scored
    layer, from its captured projections and RoPE, within its local window."""
    plan, sequence, adapter, scored = sources.plan, sources.sequence, sources.adapter, sources.scored
    module, rope = scored.attention, scored.rope
    queries, keys = adapter.queries_and_keys(module, scored.query_out, scored.key_out)
    rows = sequence.columns_of_rows(plan.text_rows)  # [B, R]
    picked = queries.gather(
        2, rows[:, None, :, None].expand(-1, queries.shape[1], -1, queries.shape[-1]).to(queries.device)
    )
    return _rows_attention(sources, module, picked, keys, rope, rows, sources.window)


def _rows_attention(
    sources: Sources,
    module: torch.nn.Module,
    queries: torch.Tensor,
    keys: torch.Tensor,
    rope: Any,
    rows: torch.Tensor,
    window: Window | None,
) -> RowAttention:
    """The recomputed rows' queries [B, H, R, d] (at columns ``rows`` [B, R]) and ``keys`` [B, Hkv, S', d],
    both given before RoPE, made ready for attention as ``module`` computes it: RoPE ``rope`` of the
    current columns, its query temperature at the rows' places in the prompt, its local ``window``."""
    adapter, plan = sources.adapter, sources.plan
    queries = adapter.rotate(module, queries, adapter.gather_rope(rope, rows))  # [B, H, R, d]
    queries = _placed(adapter, module, queries, plan.text_rows)
    keys = adapter.rotate(module, keys, rope)  # [B, Hkv, S', d]
    spec = row_spec(plan, sources.sequence, rows, window)
    return RowAttention(queries, keys, spec, adapter.scaling(module), heads=queries.shape[1])


def _placed(
    adapter: FamilyAdapter, module: torch.nn.Module, queries: torch.Tensor, places: torch.Tensor
) -> torch.Tensor:
    """Queries [B, H, R, d] times the factor ``module`` scales them by at their places ``places`` [B, R] in
    the prompt (``adapter.scales_queries``: Llama 4's attention temperature); as they are otherwise."""
    if not adapter.scales_queries(module):
        return queries
    factors = adapter.query_scales(module, places.to(queries.device))  # [B, R, 1]
    return (queries * factors[:, None]).to(queries.dtype)


def next_layer_attention(sources: Sources) -> RowAttention:
    """The recomputed text rows as the next decoder layer would attend with them on
    its input ``hidden`` [B, S', D] (the scored layer's output), before it runs: its input norm, query
    and key projections, the adapter's q/k norms, its RoPE (cos, sin) [B or 1, S', d], gathered to the
    current columns, and its local window.

    PyramidDrop ranks at a stage boundary with the first layer of the next stage (``rank_layer =
    layer_idx + 1`` in ``modeling_llama_pdrop.py``, Xing et al., CVPR 2025)."""
    plan, sequence, adapter, hidden = sources.plan, sources.sequence, sources.adapter, sources.hidden
    rope = sources.rope
    if sequence.positions is not None:
        rope = adapter.gather_rope(rope, sequence.positions)
    module = adapter.attention(sources.next_layer)
    normed = adapter.input_norm(sources.next_layer)(hidden)  # [B, S', D]
    rows = sequence.columns_of_rows(plan.text_rows).to(hidden.device)  # [B, R]
    picked = normed.gather(1, rows[:, :, None].expand(-1, -1, normed.shape[-1]))  # [B, R, D]
    queries, keys = adapter.queries_and_keys(
        module, adapter.query_projection(module)(picked), adapter.key_projection(module)(normed)
    )
    return _rows_attention(sources, module, queries, keys, rope, rows, sources.next_window)


def group_attention(
    attention: RowAttention,
    group: PoolGroup,
    pool_rows: list[PoolRows],
    config: PruningConfig,
    chunk_elements: int | None = None,
) -> dict[str, Any]:
    """The ``StageInputs`` attention fields of a group: Q, P and the last row, normalised
    (``scoring.reduced_evidence``), and the instruction rows for methods that weigh them one by one.

    The text rows' attention is computed a chunk of rows at a time (``attention.chunks``, at most
    ``chunk_elements`` elements a chunk; None: ``ROW_CHUNK_ELEMENTS``, read when called) and reduced as
    it comes: each pool's prior rows and last row taken from the chunk that holds them, the posterior
    summed over rows of each row's head aggregate (in the attention's dtype), so that no [G, H, R, S']
    tensor exists. Rows that fit one chunk give what one tensor of every row gives, bit for bit."""
    every_row = group.row_list == list(range(attention.queries.shape[0]))
    size = group.size
    device = attention.queries.device
    columns = group.columns.to(device)[:, None, None, :]  # [G, 1, 1, n]
    separator_rows = _padded_stack([rows.prior for rows in pool_rows])  # [G, I] each item's prior row
    prior_rows = separator_rows.to(device).gather(1, group.item_of.to(device))  # [G, n]
    last = stack_views([rows.last_index for rows in pool_rows]).to(device).reshape(-1, 1)  # [G, 1]
    valid = stack_views([rows.posterior for rows in pool_rows]).to(device)  # [G, R]
    check_posterior_rows(valid)
    prior = last_row = posterior = None  # [G, H, n], [G, H, n], [G, n] once the first chunk is in
    weighed = "text_rows" in config.method.needs
    text_rows = torch.empty(len(pool_rows), attention.count, size, device=device) if weighed else None
    for chunk in attention.chunks(ROW_CHUNK_ELEMENTS if chunk_elements is None else chunk_elements):
        block = attention.rows(chunk)  # [B, H, r, S']
        per_pool = block if every_row else block.index_select(0, group.rows)  # [G, H, r, S']
        heads, n_rows = per_pool.shape[1], per_pool.shape[2]
        visual = per_pool.gather(3, columns.expand(-1, heads, n_rows, -1))  # [G, H, r, n]
        del block, per_pool
        prior = _take_rows(visual, prior_rows, chunk, attention.count, prior)
        last_row = _take_rows(visual, last.expand(-1, size), chunk, attention.count, last_row)
        aggregated = aggregate_heads(visual.transpose(1, 2), config.heads)  # [G, r, n]
        kept = torch.where(valid[:, chunk, None], aggregated, torch.zeros((), dtype=aggregated.dtype))
        summed = kept.sum(dim=1)  # [G, n]
        posterior = summed if posterior is None else posterior + summed
        if text_rows is not None:
            text_rows[:, chunk] = aggregate_heads(visual.transpose(1, 2).float(), config.heads)
    for g, pool in enumerate(group.pools):
        if len(pool.items) > 1:
            prior[g] = per_item_prior(prior[g], group.item_of[g].to(device), len(pool.items))
    posterior = posterior / valid.sum(dim=-1, keepdim=True).to(posterior.dtype)  # [G, n] mean of valid rows
    fields: dict[str, Any] = {
        "attention": reduced_evidence(prior, posterior, last_row, heads=config.heads, seed=config.seed),
        "text_valid": valid,
    }
    if text_rows is not None:
        fields["text_rows"] = text_rows  # [G, R, n]
    return fields


def _padded_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[G, I] the 1-D ``tensors`` stacked, zero-padded to the longest (device work only)."""
    if len({tensor.numel() for tensor in tensors}) == 1:
        return stack_views(tensors)
    return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True)


def _take_rows(
    visual: torch.Tensor, rows: torch.Tensor, chunk: slice, count: int, taken: torch.Tensor | None
) -> torch.Tensor:
    """Each token's entry of its row ``rows`` [G, n] (indices into the R = ``count`` rows) in this chunk
    ``visual`` [G, H, r, n] of rows ``chunk``, where the row lies in the chunk; ``taken`` [G, H, n]
    (None: zeros) elsewhere. On the device, without a host sync; one chunk of every row is a gather."""
    heads, n_rows = visual.shape[1], visual.shape[2]
    if n_rows == count:
        return visual.gather(2, rows[:, None, None, :].expand(-1, heads, 1, -1)).squeeze(2)
    local = rows - chunk.start
    inside = (local >= 0) & (local < n_rows)  # [G, n]
    index = local.clamp(0, n_rows - 1)[:, None, None, :].expand(-1, heads, 1, -1)
    picked = visual.gather(2, index).squeeze(2)  # [G, H, n]
    before = torch.zeros((), dtype=picked.dtype) if taken is None else taken
    return torch.where(inside[:, None, :], picked, before)


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
    capture: dict[str, torch.Tensor],
    probe: TowerShape,
    plan: PrefillPlan,
    group: PoolGroup,
    method: MethodInfo,
) -> dict[str, torch.Tensor]:
    """What the tower showed of each of the group's tokens when it ran, for the evidence ``method``
    needs: the feature layer's [CLS] attention and keys (``vision``), the last layer's [CLS] attention
    over all heads at once and its keys (``vision_last``, PruMerge), the features before the projector
    (``features``). The tower encodes the batch's images in prompt order, one image per item."""
    per_image: dict[str, torch.Tensor] = {}  # name -> [I, N, ...] one row per tower image
    needs = method.needs
    wanted = {"vision": ("q", "k"), "vision_last": ("q_last", "k_last"), "features": ("features",)}
    if any(name not in capture for need in needs & VISION_NEEDS for name in wanted[need]):
        raise ValueError(
            f"method {method.name!r} needs the vision tower's evidence, but the tower did not run for this "
            "prompt; pass pixel_values (not precomputed image features)"
        )
    if "vision" in needs:
        cls, keys = cls_attention(capture["q"], capture["k"], probe.heads, probe.scaling, probe.first_token)
        per_image["vision_cls"], per_image["vision_keys"] = cls, keys.transpose(1, 2)  # [I, N, H, d]
    if "vision_last" in needs:
        cls, keys = cls_attention_concatenated(
            capture["q_last"], capture["k_last"], probe.width, probe.first_token
        )
        per_image["vision_cls_last"], per_image["vision_keys_last"] = cls, keys
    if "features" in needs:
        per_image["vision_features"] = capture["features"]
    images = [item for pool in plan.pools for item in pool.items]
    counts = {tuple(value.shape[:2]) for value in per_image.values()}
    n_images, n_tokens = counts.pop() if len(counts) == 1 else (-1, -1)
    if any(item.modality != "image" for item in images) or len(images) != n_images:
        raise ValueError(
            f"the vision tower saw {n_images} images but the prompts hold {len(images)} visual "
            "items; [CLS]-ranked methods need one tower image per prompt image"
        )
    if max(item.size for item in images) > n_tokens:
        raise ValueError(
            f"the vision tower gave {n_tokens} tokens per image but an image has more visual "
            "tokens in the prompt; use the processor's image size"
        )
    slot = {(item.row, item.separator): index for index, item in enumerate(images)}  # host ints: traceable
    image_of = torch.zeros(len(group.pools), max(len(pool.items) for pool in group.pools), dtype=torch.long)
    for g, pool in enumerate(group.pools):
        image_of[g, : len(pool.items)] = torch.tensor([slot[item.row, item.separator] for item in pool.items])
    device = next(iter(per_image.values())).device
    image = to_device(image_of, device)  # [G, I] tower image of each item
    image = image.gather(1, group.item_of.to(device))  # [G, n] tower image of each token
    offset = group.offset.to(device)
    out = {name: value[image, offset] for name, value in per_image.items()}  # [G, n, ...]
    if "vision_keys" in out:
        out["vision_keys"] = out["vision_keys"].permute(0, 2, 1, 3)  # [G, H, n, d]
    return out
