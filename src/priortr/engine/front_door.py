"""The engine's front door, for a front end that runs the decoder layers itself (the vLLM plug-in).

``priortr.apply`` reaches the engine through its hooks; a front end that owns the batch, the layers and
the cache (vLLM runs layers 0..L of a pruned prompt itself and writes the kept tokens' keys and values
into its paged cache) reaches it here, and only here, with plain values and tensors in and out:

* ``kept_runs``: before the prompt is scheduled, the runs of visual tokens ``priortr.apply`` prunes in a
  prompt and how many tokens each keeps (the budget split, and the prompt checks, of ``apply``);
* ``StagedPrompt``: the prompt planned once and fed stage by stage as the front end runs its layers
  (one stage for a one-layer method; CLSE's, PyramidDrop's or a ``stages`` schedule's several): after
  the front end ran a scored layer, the columns of the prompt's current tokens that survive it, chosen
  by the method through the stage core every front end shares (``priortr.engine.stage``);
  ``last_stage`` is the deepest layer a configuration scores;
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
from priortr.engine.plan import PrefillPlan, plan_on_host, plan_prefill
from priortr.engine.pools import Pool
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
    tokens), in prompt order, under ``config``'s budget, each with the tokens it keeps after its last
    stage; raises the library's ValueError for a prompt the method cannot score (e.g. an image with no
    instruction after it). The images' grids are not read: they change no count."""
    ids = torch.tensor([list(prompt)])
    n_layers = model_config.get_text_config().num_hidden_layers
    valid = torch.ones_like(ids, dtype=torch.bool)
    host = plan_on_host(adapter, model_config, config, ids, valid, n_layers, read_grids=False)
    if host is None:
        return []
    runs = []
    for pool in host.pools:
        kept = _final_count(config, pool)
        if kept < 1:
            raise ValueError(
                f"{config.method.name} keeps no token of a run of {pool.size} at a budget of "
                f"{pool.stages[-1][1]}"
            )
        runs.append(KeptRun(int(pool.positions[0]), pool.size, kept))
    return runs


def _final_count(config: PruningConfig, pool: Pool) -> int:
    """The tokens ``pool`` keeps after its last stage (all of them when its schedule has none): the
    stage's count, or what a method that keeps another count than its budget keeps
    (``PruningConfig.kept_count``: VisionZip's budget counts its [CLS] token)."""
    return config.kept_count(pool.stages[-1][1], pool.size) if pool.stages else pool.size


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


def last_stage(config: PruningConfig, n_layers: int) -> int:
    """The deepest decoder layer ``config`` scores in a language model of ``n_layers`` layers, for any
    image: a front end runs the layers up to it outside its cache. A schedule's layers depend on the
    depth alone (an image so small that it keeps every token skips its stages)."""
    return max(layer for layer, _ in config.schedule(1 << 20, n_layers))


class StagedPrompt:
    """One prompt of S tokens (token ids, every image laid out with all its tokens) planned for every
    stage of ``config`` (one, or a schedule's several), for a front end that runs the decoder layers
    itself and feeds the stages as it goes: after the layer a stage scores (``layers``) ran on the
    prompt's current tokens, ``cut`` takes that layer's tensors and returns which of those tokens
    survive. Between stages the state the stages left (``StageState``: the pools' survivors and the map
    of the current sequence) stays here, as ``priortr.apply``'s prefill keeps it; each stage is the
    stage core ``priortr.apply`` runs (``priortr.engine.stage.run_stage``), on the evidence the front
    end's tensors give.

    ``counts`` are the tokens each run keeps after its last stage (``kept_runs``' counts, as the front
    end laid the prompt out): a one-layer method's plan takes them as its budgets (a request's own
    budget reaches the front end only as its slots); a method that prunes at several layers plans its
    stages from ``config``'s budget, and counts that plan disagrees with are refused. ``positions``
    [3, S] (host) are the prompt's positions as the model numbers them, where the family's grids are
    read from them (a method that reads each image's grid: Qwen2-VL's M-RoPE height and width ids).
    ``device``: where the front end's tensors are.
    """

    def __init__(
        self,
        adapter: FamilyAdapter,
        model_config: object,
        config: PruningConfig,
        prompt: Sequence[int],
        counts: Sequence[int],
        positions: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> None:
        ids = torch.tensor([list(prompt)])  # on the host, where the plan is made
        valid = torch.ones_like(ids, dtype=torch.bool)
        n_layers = model_config.get_text_config().num_hidden_layers
        one_layer = config.stages is None and config.method.schedule is None
        arguments = {} if positions is None else {"position_ids": positions[:, None]}  # [3, 1, S]
        plan = plan_prefill(
            adapter,
            model_config,
            config,
            ids,
            valid,
            n_layers,
            counts=counts if one_layer else None,
            device=device,
            arguments=arguments,
        )
        if plan is None:
            raise RuntimeError("priortr: the planned prompt lost its images")
        planned = [_final_count(config, pool) for pool in plan.pools]
        if planned != list(counts):
            raise RuntimeError(
                f"priortr: the prompt was laid out for {list(counts)} kept tokens per run and its stages "
                f"keep {planned}; the processor's plan and the step's disagree"
            )
        self.plan: PrefillPlan = plan
        self.config = config
        self.state = StageState.of_prompt(plan)

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers this prompt's stages score, ascending (none where every image keeps all)."""
        return self.plan.stages

    @property
    def reads_next_layer(self) -> bool:
        """Whether a stage ranks by the attention of the layer after the one it scores (PyramidDrop):
        ``cut`` then takes that next layer's queries and keys, computed on the stage's input."""
        return "next_attention" in self.config.method.needs

    @property
    def reads_embeddings(self) -> bool:
        """Whether a stage reads the hidden states that entered decoder layer 0 (CLSE, SparseVLM)."""
        return "input_embeddings" in self.config.method.needs

    def cut(
        self, layer: int, scored: ScoredLayerTensors, embeddings: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The stage scored at ``layer`` on the prompt's current S' tokens: ``scored`` holds layer
        ``layer``'s tensors over them (the next layer's queries and keys where ``reads_next_layer``),
        ``embeddings`` [1, S, D] the whole prompt's input of decoder layer 0 (where
        ``reads_embeddings``). Returns the columns [S''] of the S' tokens that survive, ascending, or
        None where the stage keeps every one; the state moves on to the survivors."""
        before = self.state
        sequence = before.sequence
        rows = None
        if self.plan.text_rows is not None:
            columns = sequence.columns_of_rows(self.plan.text_rows)  # [1, R] the text rows' columns
            rows = RowAttention(
                scored.queries.index_select(2, columns[0]),  # [1, h, R, d]
                scored.keys,
                RowSpec(columns, sequence.key_valid()),
                scored.scaling,
                heads=scored.heads,
                gather=scored.gather,
            )
        sources = _GivenRows(
            self.plan, before, self.config, hidden=scored.output, embeddings=embeddings, rows=rows, at=layer
        )
        outcome = run_stage(layer, sources, scored.output)
        if outcome.merged:
            raise RuntimeError(
                f"priortr: {self.config.method.name} merged tokens, which a front end that keeps each "
                "token's keys and values cannot write"
            )
        self.state = outcome.state
        if outcome.state is before:  # every visual token kept
            return None
        return sequence.columns_of_rows(outcome.state.sequence.positions)[0]


@dataclass(frozen=True)
class _GivenRows(Sources):
    """A stage's evidence whose recomputed text rows the front end's tensors give (``StagedPrompt``),
    where ``priortr.apply``'s hooks recompute them from the projections they captured; ``at`` is the
    layer the stage scores, which the hooks' captured layer tells."""

    rows: RowAttention | None = field(kw_only=True)
    at: int = field(kw_only=True)

    @property
    def layer(self) -> int:
        return self.at

    @property
    def text_attention(self) -> RowAttention:
        if self.rows is None:
            raise RuntimeError("priortr: the plan laid out no text rows for a method that reads attention")
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
    the stage core ``priortr.apply`` runs before layer 0. ``counts`` as for ``StagedPrompt``."""
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
