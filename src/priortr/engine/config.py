"""What to prune and how (``PruningConfig``), checked when it is made (``PruningConfig.of``), before any
forward pass, so that every front end (``priortr.apply``, the vLLM plug-in) refuses a bad setting with the
same message."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from priortr.methods import MethodInfo, get_method
from priortr.methods.scoring import HEAD_AGGREGATIONS as HEAD_AGGREGATIONS

if TYPE_CHECKING:
    import torch

    from priortr.adapters import FamilyAdapter

DEFAULT_BUDGET = 64
VISION_NEEDS = frozenset({"vision", "vision_last", "features"})
"""Evidence read from the vision tower as it runs (``VisionProbe``), before the language model."""

POSTERIOR_ROWS = ("from_separator", "after_separator", "from_separator_except_last", "last")
"""The rows averaged into the posterior P (``pool_rows``): ``from_separator``, the paper's rows j >= i_e
(Appendix A.3, "Extracting Q and P"; the default); ``after_separator``, the rows after the separator
(the library's default before issue 48); ``from_separator_except_last``, rows i_e .. T-2 (the authors'
Qwen2-VL / Qwen3-VL strategy, ``question_start:-1``); ``last``, the last prompt token's row."""
MULTI_IMAGE = ("per_image", "global")
"""How the items of a prompt row share the budget: each ranked alone under its share, or all together."""
BEFORE_LLM = -1
"""The stage layer of methods that prune the language model's input embeddings (``where='vision'``)."""


class PruningSkippedWarning(UserWarning):
    """A forward pass ran unpruned because its prompt has nothing to prune."""


class DegenerateScoresWarning(UserWarning):
    """A method ranked an image on scores that are NaN or all zero, so its kept tokens are not a ranking."""


@dataclass(frozen=True)
class PruningConfig:
    """What to prune and how; made and checked by ``PruningConfig.of``.

    ``layer`` is the 0-indexed decoder layer whose attention is scored by a one-layer method; layers
    ``layer+1 ..`` run on the kept tokens (the authors' code calls this "prune layer layer+1"). A method
    that prunes before the language model or on its own schedule has no layer (None).
    ``stages`` replaces the method's schedule by explicit (scored layer, budget) pairs, the budgets
    counting or taking a ratio of the image's visual tokens. ``options`` are the selector's knobs as
    (name, value) pairs sorted by name (``dict(config.options)`` reads them): a tuple, since a
    configuration is frozen (the vLLM plug-in shares one across requests) and a compiled stage reads
    it without a graph break (dynamo breaks on a ``MappingProxyType`` once a dict has changed).
    ``posterior_rows`` chooses the rows averaged into P (``POSTERIOR_ROWS``): the separator and every
    prompt token after it (default, the paper's j >= i_e), the tokens after it only, the separator to
    the token before the last (the authors' Qwen code), or the last prompt token only.
    ``separator_offset`` moves the prior's slot that many tokens after the first post-image token
    (the paper's null-token ablation). ``multi_image`` says how the items of a row share the budget
    (``priortr.engine.pools``). ``strict`` raises instead of warning when a prompt has nothing to prune, and
    turns on the checks that read tensor values (they block the host on a GPU, so they are off by
    default: ``priortr.methods.value_checks``).
    """

    method: MethodInfo
    budget: int | float
    layer: int | None
    stages: tuple[tuple[int, int | float], ...] | None = None
    options: tuple[tuple[str, Any], ...] = ()
    heads: str = "mean"
    posterior_rows: str = "from_separator"
    separator_offset: int = 0
    multi_image: str = "per_image"
    strict: bool = False
    seed: int = 0

    @classmethod
    def of(
        cls,
        method: str = "priortr",
        budget: int | float | None = None,
        layer: int | None = None,
        *,
        n_layers: int,
        stages: Sequence[tuple[int, int | float]] | None = None,
        options: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> PruningConfig:
        """The checked configuration of ``priortr.apply``'s keywords for a language model of ``n_layers``
        decoder layers; ``settings`` are the other fields (heads, posterior_rows, separator_offset,
        multi_image, strict, seed), each checked against what it accepts."""
        info = get_method(method)
        if stages is not None and (budget is not None or layer is not None):
            given = ", ".join(
                f"{name}={value!r}"
                for name, value in (("budget", budget), ("layer", layer))
                if value is not None
            )
            raise ValueError(
                f"stages= sets the layer and budget of every stage, so it conflicts with {given}; "
                "pass either stages or budget/layer"
            )
        budget = DEFAULT_BUDGET if budget is None else budget
        resolve_budget(budget, n_visual=1 << 30)  # validates type and range before any forward pass
        for name, value in settings.items():
            _check_setting(name, value)
        return cls(
            method=info,
            budget=budget,
            layer=_check_layer(info, layer, n_layers),
            stages=_check_stages(info, stages, n_layers),
            options=_check_options(info, options),
            **settings,
        )

    def check_fits(self, adapter: FamilyAdapter, model: torch.nn.Module, n_layers: int) -> None:
        """Refuse a configuration ``model`` cannot run: evidence from a vision tower without a [CLS] token,
        an image's token grid from a family that defines none, stages while the model still adds visual
        features to the hidden states (DeepStack), or attention read at a layer without softmax
        attention."""
        if self.method.needs & VISION_NEEDS and adapter.vision_probe(model) is None:
            raise ValueError(
                f"{self.method.name} ranks by the vision tower's [CLS] attention, and this {adapter.name} "
                "model's vision tower has no [CLS] token; use a method that needs none (divprune, dart, "
                "or an in-LLM method)"
            )
        if "grid" in self.method.needs:
            check_grids(self, adapter)
        check_injection(self, adapter.injected_layers(model), n_layers)
        _check_scored_layers(self, adapter.scored_layers(model), n_layers)

    def schedule(
        self, n_visual: int, n_layers: int, part: tuple[int, int] | None = None
    ) -> list[tuple[int, int]]:
        """The (scored layer, tokens kept after it) stages of a pool of ``n_visual`` tokens.

        ``part`` = (the row's visual tokens before this pool, all of them) splits a count budget over
        the pools of a row in proportion to their sizes (``split_count``); ratios need no split.
        """

        def count(budget: int | float) -> int:
            if part is not None and isinstance(budget, int):
                budget = split_count(budget, part[0], n_visual, part[1])
            return resolve_budget(budget, n_visual)

        if self.stages is not None:
            return [(layer, count(budget)) for layer, budget in self.stages]
        kept = count(self.budget)
        if self.method.schedule is not None:
            if self.method.schedule_ratio and isinstance(self.budget, float):
                return self.method.schedule(self.budget, n_visual, n_layers)
            return self.method.schedule(kept, n_visual, n_layers)
        return [(self.stage_layer, kept)]

    def kept_count(self, budget: int, n_visual: int) -> int:
        """The visual tokens a one-stage pool of ``n_visual`` keeps under a count budget of ``budget``:
        ``min(budget, n_visual)``, unless the method keeps another count (``MethodInfo.keeps``)."""
        if budget >= n_visual or self.method.keeps is None:
            return min(budget, n_visual)
        return self.method.keeps(budget, n_visual, **{**self.method.knobs, **dict(self.options)})

    def budget_for(self, kept: int, n_visual: int) -> int:
        """The smallest count budget under which a one-stage pool of ``n_visual`` keeps ``kept`` tokens
        (``kept_count``'s inverse, for a front end that laid out ``kept`` slots)."""
        for budget in range(kept, n_visual + 1):
            if self.kept_count(budget, n_visual) == kept:
                return budget
        raise ValueError(f"{self.method.name} keeps {kept} of {n_visual} tokens under no budget")

    @property
    def stage_layer(self) -> int | None:
        """The layer of a one-stage method's stage: ``BEFORE_LLM`` for a method that prunes the language
        model's input embeddings, else its scored ``layer`` (None for a method on a schedule)."""
        return BEFORE_LLM if self.method.where == "vision" else self.layer


_CHOICES = {"heads": HEAD_AGGREGATIONS, "posterior_rows": POSTERIOR_ROWS, "multi_image": MULTI_IMAGE}


def _check_setting(name: str, value: Any) -> None:
    """Refuse a value that setting ``name`` does not accept."""
    if name in _CHOICES and value not in _CHOICES[name]:
        raise ValueError(f"{name} must be one of {', '.join(_CHOICES[name])}; got {value!r}")
    if name == "separator_offset" and (not is_int(value) or value < 0):
        raise ValueError(f"separator_offset must be an int >= 0; got {value!r}")
    if name == "strict" and not isinstance(value, bool):
        raise ValueError(f"strict must be True or False; got {value!r}")
    if name == "seed" and not is_int(value):
        raise ValueError(f"seed must be an int; got {value!r}")


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_budget(budget: int | float, n_visual: int) -> int:
    """Turn a budget into a token count K with 1 <= K <= n_visual.

    An int is an absolute count K (capped at ``n_visual``); a float in (0, 1) is a keep ratio rounded half
    up, with at least one token kept. Anything else is rejected with a message saying what to pass.
    """
    if isinstance(n_visual, bool) or not isinstance(n_visual, int) or n_visual < 1:
        raise ValueError(f"n_visual must be an int >= 1, got {n_visual!r}")
    if isinstance(budget, bool):
        raise ValueError(
            f"budget must not be a bool ({budget!r}); pass an int for a token count, or a ratio in (0, 1)"
        )
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be a positive token count, got {budget}; pass an int >= 1")
        return min(budget, n_visual)
    if isinstance(budget, float):
        if math.isnan(budget):
            raise ValueError("budget is NaN; pass an int for a token count, or a ratio in (0, 1)")
        if not 0.0 < budget < 1.0:
            raise ValueError(
                f"float budget {budget!r} is not a ratio; pass an int for a token count, or a ratio in (0, 1)"
            )
        return max(1, math.floor(budget * n_visual + 0.5))
    raise ValueError(
        f"budget must be int or float, got {type(budget).__name__}; "
        "pass an int for a token count, or a ratio in (0, 1)"
    )


def split_count(count: int, before: int, size: int, total: int) -> int:
    """An item's share of a row's ``count`` tokens: the rounded cumulative share of the row's ``total``
    visual tokens up to its end minus that up to its start, so the shares sum to ``count`` exactly."""

    def cumulative(tokens: int) -> int:
        return math.floor(count * tokens / total + 0.5)

    return max(1, cumulative(before + size) - cumulative(before))


def _check_layer(info: MethodInfo, layer: int | None, n_layers: int) -> int | None:
    """The scored layer of a one-layer method; None for a method that has none."""
    if info.where != "layer":
        if layer is not None:
            where = "before the language model" if info.where == "vision" else "on its own schedule of layers"
            raise ValueError(f"{info.name} prunes {where}; it takes no layer (leave layer=None)")
        return None
    if layer is None:
        layer = info.default_layer
    if not is_int(layer) or not 0 <= layer <= n_layers - 2:
        raise ValueError(
            f"layer must be an int in [0, {n_layers - 2}] for this {n_layers}-layer model "
            f"(the scored layer must have a layer after it); got {layer!r}"
        )
    return layer


def _check_stages(
    info: MethodInfo, stages: Sequence[tuple[int, int | float]] | None, n_layers: int
) -> tuple[tuple[int, int | float], ...] | None:
    if stages is None:
        return None
    if info.where == "vision":
        raise ValueError(f"{info.name} prunes before the language model; it takes no stages")
    given = stages
    if isinstance(stages, str | bytes) or not isinstance(stages, Sequence):
        stages = ()
    stages = tuple(tuple(stage) if isinstance(stage, Sequence) else (stage,) for stage in stages)
    if not stages or any(len(stage) != 2 for stage in stages):
        raise ValueError(f"stages must be a non-empty list of (layer, budget) pairs; got {given!r}")
    layers = [stage[0] for stage in stages]
    if not all(is_int(layer) and 0 <= layer <= n_layers - 2 for layer in layers) or layers != sorted(
        set(layers)
    ):
        raise ValueError(
            f"stage layers must be strictly increasing ints in [0, {n_layers - 2}]; got {layers}"
        )
    counts = [resolve_budget(budget, n_visual=1 << 30) for _, budget in stages]  # validates each budget
    if counts != sorted(counts, reverse=True) or len({type(budget) for _, budget in stages}) != 1:
        raise ValueError(
            "stage budgets must all be counts or all ratios, and must not increase; "
            f"got {[budget for _, budget in stages]}"
        )
    return stages


def _check_options(info: MethodInfo, options: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """The method's knobs ``options`` checked, as (name, value) pairs sorted by name (the configuration
    is frozen)."""
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(f"options must be a dict of the method's knobs by name; got {options!r}")
    options = dict(options or {})
    unknown = sorted(set(options) - set(info.knobs))
    if unknown:
        known = ", ".join(f"{name}={default!r}" for name, default in info.knobs.items()) or "none"
        raise ValueError(f"{info.name} has no option {', '.join(unknown)}; its options: {known}")
    if info.check_knobs is not None:
        info.check_knobs(**{**info.knobs, **options})
    return tuple(sorted(options.items()))


def check_grids(config: PruningConfig, adapter: FamilyAdapter) -> None:
    """Refuse a method that reads each image's token grid (CLSE's 2-D FFT, downsample's pooling) where
    there is none: a family whose adapter defines no grid (``FamilyAdapter.token_grids``; its
    ``no_grid`` says why), or images ranked together."""
    name = config.method.name
    if not adapter.token_grids:
        raise ValueError(
            f"{name} works on each image's 2-D token grid, and the {adapter.name} adapter defines no grid "
            f"for an image: {adapter.no_grid}; use it on LLaVA-1.5, Video-LLaVA images, Qwen2-VL / "
            "Qwen2.5-VL, GLM-4.1V or Qwen3.5, or another method here"
        )
    if config.multi_image != "per_image":
        raise ValueError(f"{name} works on each image's own grid; use multi_image='per_image'")


def check_injection(config: PruningConfig, injected: int, n_layers: int) -> None:
    """Refuse stages that would prune while the model still adds visual features to the hidden states
    (Qwen3-VL's DeepStack injects into the outputs of its first ``injected`` layers); the vLLM plug-in
    runs it when the engine starts."""
    if injected == 0:
        return
    first = min(layer for layer, _ in config.schedule(1 << 20, n_layers))
    if first < injected - 1:
        where = "before the language model" if first == BEFORE_LLM else f"after layer {first}"
        raise ValueError(
            f"this model adds visual features to the outputs of decoder layers 0..{injected - 1} "
            "(DeepStack), "
            f"so {config.method.name} cannot prune {where}; score layer {injected - 1} or later"
        )


def _check_scored_layers(config: PruningConfig, attention: list[int], n_layers: int) -> None:
    """Refuse stages whose evidence needs attention rows at a layer that cannot be scored (Qwen3.5's
    linear-attention layers have a recurrent state, no attention matrix; Gemma 4's KV-shared layers no
    key projection): the scored layer itself (``attention``, ``keys``) or the one after it
    (``next_attention``)."""
    offset = 1 if "next_attention" in config.method.needs else 0
    if not config.method.needs & {"attention", "keys", "next_attention"} or len(attention) == n_layers:
        return
    for layer, _ in config.schedule(1 << 20, n_layers):
        if layer == BEFORE_LLM or layer + offset in attention:
            continue
        allowed = [index - offset for index in attention if 0 <= index - offset <= n_layers - 2]
        nearest = min(allowed, key=lambda index: (abs(index - layer), index), default=None)
        which = "the layer after the scored one" if offset else "the scored layer"
        raise ValueError(
            f"{config.method.name} reads attention at {which}, and decoder layer {layer + offset} of this "
            f"model has no softmax attention over keys of its own (only layers {attention} do); "
            + (
                f"score layer {nearest} instead"
                if nearest is not None
                else "no layer of this model can be scored"
            )
        )
