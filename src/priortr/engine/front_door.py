"""The engine's front door, for a front end that runs the decoder layers itself (the vLLM plug-in).

``priortr.apply`` reaches the engine through its hooks; a front end that owns the batch, the layers and
the cache (vLLM runs layers 0..L of a pruned prompt itself and writes the kept tokens' keys and values
into its paged cache) reaches it here, and only here, with plain values and tensors in and out:

* ``kept_runs``: before the prompt is scheduled, the runs of visual tokens ``priortr.apply`` prunes in a
  prompt and how many tokens each keeps (the budget split, and the prompt checks, of ``apply``);
* ``kept_columns``: after the front end ran the scored layer, the columns of the prompt that survive it,
  chosen by the method through the stage core every front end shares (``priortr.engine.stage``);
* ``kept_before_llm``: for a method that prunes before the language model (``where='vision'``), the
  columns that survive and their input embeddings (merged ones included), from the prompt's embeddings
  and what the vision tower showed (``TowerEvidence``), through the same stage core.

Both plan the prompt with the plan's one constructor (``priortr.engine.plan``), so a front end never
builds the engine's types itself (``tests/unit/test_layout.py`` holds ``integrations/`` to this module
and ``priortr.engine.config``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from priortr.adapters import FamilyAdapter
from priortr.engine.attention import RowSpec
from priortr.engine.config import BEFORE_LLM, PruningConfig
from priortr.engine.evidence import RowAttention, Sources
from priortr.engine.plan import plan_on_host, plan_prefill
from priortr.engine.stage import run_stage
from priortr.engine.state import StageState


class KeptRun(NamedTuple):
    """One run of visual tokens that ``priortr.apply`` ranks as one item (an image, or images with no
    text between them): the prompt index of its first token, its tokens, and how many of them it keeps
    after the scored layer."""

    start: int
    size: int
    kept_count: int


def kept_runs(
    adapter: FamilyAdapter, model_config: object, config: PruningConfig, prompt: Sequence[int]
) -> list[KeptRun]:
    """The runs ``priortr.apply`` prunes in ``prompt`` (token ids, every image laid out with all its
    tokens), in prompt order, under ``config``'s budget; raises the library's ValueError for a prompt
    the method cannot score (e.g. an image with no instruction after it)."""
    ids = torch.tensor([list(prompt)])
    n_layers = model_config.get_text_config().num_hidden_layers
    host = plan_on_host(adapter, model_config, config, ids, torch.ones_like(ids, dtype=torch.bool), n_layers)
    if host is None:
        return []
    runs = []
    for pool in host.pools:
        budget = pool.kept_count(config.stage_layer)
        kept = config.kept_count(budget, pool.size)
        if kept < 1:
            raise ValueError(
                f"{config.method.name} keeps no token of a run of {pool.size} at a budget of {budget}"
            )
        runs.append(KeptRun(int(pool.positions[0]), pool.size, kept))
    return runs


@dataclass(frozen=True)
class ScoredLayerTensors:
    """What a front end hands over of the scored layer it ran on a whole prompt of S tokens.

    ``queries`` [1, h, S, d] and ``keys`` [1, h_kv, S, d] after RoPE (and any query scaling or norm the
    layer applies), ``output`` [1, S, D] the layer's output (the input of the layer after it),
    ``scaling`` the layer's softmax scale; ``heads`` is H, the heads an attention row has after
    ``gather``, which joins this rank's h heads of a chunk of rows [1, h, r, S] with every other
    rank's under tensor parallelism (None: h = H, nothing to join).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    output: torch.Tensor
    scaling: float
    heads: int
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None


def kept_columns(
    adapter: FamilyAdapter,
    model_config: object,
    config: PruningConfig,
    prompt: Sequence[int],
    counts: Sequence[int],
    scored: ScoredLayerTensors,
) -> torch.Tensor:
    """The columns [P] of ``prompt`` (token ids, every image laid out with all its tokens) that survive
    ``config``'s stage at its scored layer, ascending: its text and the kept visual tokens, chosen by the
    method from ``scored`` through the stage core ``priortr.apply`` runs. ``counts`` are the tokens each
    run keeps (``kept_runs``' counts, as the front end laid the prompt out), in prompt order."""
    device = scored.output.device
    ids = torch.tensor([list(prompt)])  # on the host, where the plan is made
    valid = torch.ones_like(ids, dtype=torch.bool)
    n_layers = model_config.get_text_config().num_hidden_layers
    plan = plan_prefill(adapter, model_config, config, ids, valid, n_layers, counts=counts, device=device)
    if plan is None or plan.stages != (config.layer,):
        raise RuntimeError("priortr: the planned prompt lost its images or its scored layer")
    attention = RowAttention(
        scored.queries.index_select(2, plan.text_rows[0]),  # [1, h, R, d]
        scored.keys,
        RowSpec(plan.text_rows, plan.valid),
        scored.scaling,
        heads=scored.heads,
        gather=scored.gather,
    )
    state = StageState.of_prompt(plan)
    sources = _GivenRows(plan, state, config, hidden=scored.output, rows=attention)
    outcome = run_stage(config.layer, sources, scored.output)
    if outcome.state is state:  # every visual token kept
        return torch.arange(plan.seq, device=device)
    return outcome.state.sequence.positions[0]


@dataclass(frozen=True)
class _GivenRows(Sources):
    """A stage's evidence whose recomputed text rows the front end's tensors give (``kept_columns``),
    where ``priortr.apply``'s hooks recompute them from the projections they captured."""

    rows: RowAttention = field(kw_only=True)

    @property
    def text_attention(self) -> RowAttention:
        return self.rows


@dataclass(frozen=True)
class TowerEvidence:
    """What a front end captured of the vision tower while it encoded one prompt's images, for the
    pre-LLM methods that read it (``VISION_NEEDS``), as ``priortr.apply``'s hooks capture it.

    ``capture`` holds, one row per image in prompt order: ``q`` [I, 1, C] the [CLS] token's query
    projection and ``k`` [I, T, C] every token's key projection at the feature layer (``vision``), and
    ``features`` [I, N, C] the projector's input (``features``). ``heads``, ``scaling``, ``first_token``
    and ``width`` are the tower's (``priortr.adapters.base.VisionProbe``); ``project`` maps features to
    the language model's embeddings (the projector), for methods that merge features.
    """

    capture: Mapping[str, torch.Tensor]
    heads: int
    scaling: float
    first_token: int
    width: int
    project: Callable[[torch.Tensor], torch.Tensor] | None = None


def kept_before_llm(
    adapter: FamilyAdapter,
    model_config: object,
    config: PruningConfig,
    prompt: Sequence[int],
    counts: Sequence[int],
    embeddings: torch.Tensor,
    tower: TowerEvidence | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns [P] of ``prompt`` (token ids, every image laid out with all its tokens) that survive
    ``config``'s pre-LLM method, ascending, and the embeddings [P, D] they enter decoder layer 0 with (a
    merging method's survivors carry their merged embeddings), from the prompt's input embeddings
    ``embeddings`` [S, D] and the tower's evidence ``tower`` (None for a method that reads none), through
    the stage core ``priortr.apply`` runs before layer 0. ``counts`` as for ``kept_columns``."""
    device = embeddings.device
    ids = torch.tensor([list(prompt)])
    valid = torch.ones_like(ids, dtype=torch.bool)
    n_layers = model_config.get_text_config().num_hidden_layers
    if config.method.keeps is not None:  # the slots laid out are the kept counts; the plan takes budgets
        host = plan_on_host(adapter, model_config, config, ids, valid, n_layers, counts=counts)
        sizes = [pool.size for pool in host.pools] if host is not None else []
        counts = [config.budget_for(kept, size) for kept, size in zip(counts, sizes, strict=True)]
    plan = plan_prefill(adapter, model_config, config, ids, valid, n_layers, counts=counts, device=device)
    if plan is None or plan.stages != (BEFORE_LLM,):
        raise RuntimeError(
            "priortr: the planned prompt lost its images or its stage before the language model"
        )
    state = StageState.of_prompt(plan)
    hidden = embeddings[None]  # [1, S, D]
    vision = None if tower is None else (tower, dict(tower.capture))
    sources = Sources(plan, state, config, hidden, adapter, vision=vision, embeddings=hidden)
    outcome = run_stage(BEFORE_LLM, sources, hidden, None, None if tower is None else tower.project)
    if outcome.state is state:  # every visual token kept
        return torch.arange(plan.seq, device=device), embeddings
    return outcome.state.sequence.positions[0], outcome.hidden[0]
