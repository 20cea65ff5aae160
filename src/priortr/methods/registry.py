"""The registry of pruning methods: what each one reads, where it prunes, and the paper it comes from.

A method is a selector (a pure tensor function ``StageInputs -> Selection``, ``priortr.methods.selection``)
plus where it acts: ``vision`` (on the visual tokens before the language model, from vision-tower
evidence), ``layer`` (after one decoder layer, from that layer's attention or hidden states) or
``layers`` (several decoder layers, a schedule of stages). A scoring rule (``Evidence -> scores``,
e.g. PriorTR's Eq. (8)) registers as a ``layer`` method that keeps its top-K scores. The engine runs
every method through the same hooks, so they are compared on the same model, budget and harness.
Each method lives in its own module of this package and registers itself there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from priortr.methods.scoring import Evidence, select_top_k
from priortr.methods.selection import Selection, StageInputs

WHERE = ("vision", "layer", "layers")
DEFAULT_LAYER = 2
"""The decoder layer a one-layer method scores when neither it nor the caller names one (the paper's
setting for LLaVA-1.5: it scores early, Sec. 4)."""
NEEDS = (
    "attention",
    "text_rows",
    "vision",
    "vision_last",
    "features",
    "next_attention",
    "keys",
    "final_norm",
    "input_embeddings",
    "grid",
)

Selector = Callable[..., Selection]
Rule = Callable[[Evidence], torch.Tensor]
"""A scoring rule: evidence -> scores [B, N] float32, higher = keep."""
Schedule = Callable[[int, int, int], list[tuple[int, int]]]
"""(K, N, n_layers) -> [(0-indexed scored layer, visual tokens kept after it), ...]; K is the ratio
itself, a float, for a ratio budget of a method registered with ``schedule_ratio=True``."""


@dataclass(frozen=True)
class MethodInfo:
    """A registered pruning method.

    Attributes:
        name: the name ``priortr.apply`` and ``--method`` accept.
        where: ``vision``, ``layer`` or ``layers`` (see the module docstring).
        select: the selector; its keyword-only parameters are the method's knobs.
        needs: evidence the engine must gather: ``attention`` (prior, posterior, last row at the scored
            layer), ``text_rows`` (each instruction row over the visual tokens, with ``attention``)
            and/or, before the LLM, ``vision`` (the [CLS] attention and keys of the vision layer the
            model uses), ``vision_last`` (the tower's last layer's [CLS] attention over all heads at
            once, and its keys: PruMerge's) and ``features`` (the tower's features before the
            projector, which a ``merge_space='features'`` Selection merges); inside the LLM
            ``next_attention`` (the same fields as ``attention``, from the attention of the layer
            after the scored one computed on its input, before it runs), ``keys`` (the scored layer's
            keys of the visual tokens and of the text rows, and the tokens' prompt positions),
            ``final_norm`` (the scored layer's output through the language model's final norm, visual
            tokens and text rows), ``input_embeddings`` (the text rows' and the image's input
            embeddings, as they enter decoder layer 0), ``grid`` (each image's token grid (h, w) at its
            first stage, from the adapter's ``item_grids``); ``StageInputs`` documents the fields.
        summary, source: one line each for ``priortr methods`` and docs/methods.md.
        schedule: the stages of a ``layers`` method; None runs one stage.
        schedule_ratio: whether ``schedule`` takes a ratio budget as given (a float in (0, 1)) rather
            than the count it resolves to (CLSE's ratio presets are fractions of each image's tokens).
        rule: the scoring rule of a top-K method registered with :func:`register_rule`, else None.
        layer: the scored layer of a ``layer`` method when the caller names none (its paper's setting);
            None: the library's ``DEFAULT_LAYER``.
        check_knobs: takes every knob by keyword (the defaults filled in) and raises ValueError naming a
            bad value; ``priortr.apply`` calls it, so a value is refused before any forward pass (every
            built-in method with knobs has one).
        keeps: for a method that keeps another count than its budget K of a pool of n tokens (K < n),
            ``keeps(K, n, **knobs)`` that count (VisionZip's authors' K counts the [CLS] token, which has
            no slot); None: K. A front end that lays out the kept tokens before the method runs (the
            vLLM plug-in) reads it.
    """

    name: str
    where: str
    select: Selector
    needs: frozenset[str]
    summary: str
    source: str
    schedule: Schedule | None = None
    schedule_ratio: bool = False
    rule: Rule | None = None
    layer: int | None = None
    check_knobs: Callable[..., None] | None = None
    keeps: Callable[..., int] | None = None

    @property
    def default_layer(self) -> int | None:
        """The layer ``priortr.apply`` scores when the caller names none; None for a method that prunes
        before the language model or on its own schedule."""
        if self.where != "layer":
            return None
        return DEFAULT_LAYER if self.layer is None else self.layer

    @property
    def knobs(self) -> dict[str, object]:
        """The selector's keyword-only parameters and their defaults."""
        parameters = inspect.signature(self.select).parameters.values()
        return {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


_METHODS: dict[str, MethodInfo] = {}


def _add(info: MethodInfo) -> None:
    if info.name in _METHODS:
        raise ValueError(f"method {info.name!r} is already registered")
    _METHODS[info.name] = info


def register_method(
    name: str,
    *,
    where: str,
    needs: tuple[str, ...] = (),
    summary: str,
    source: str,
    schedule: Schedule | None = None,
    schedule_ratio: bool = False,
    layer: int | None = None,
    check_knobs: Callable[..., None] | None = None,
    keeps: Callable[..., int] | None = None,
) -> Callable[[Selector], Selector]:
    """Decorator adding a selector to the registry under ``name``; a duplicate name raises ValueError.
    ``schedule_ratio``: ``MethodInfo.schedule_ratio``; ``layer``: a ``layer`` method's default scored
    layer (``MethodInfo.layer``); ``check_knobs``: the
    check of its knobs' values (``MethodInfo.check_knobs``); without one, a selector with knobs checks
    their values when it first runs; ``keeps``: ``MethodInfo.keeps``."""
    if where not in WHERE:
        raise ValueError(f"where must be one of {', '.join(WHERE)}; got {where!r}")
    unknown = set(needs) - set(NEEDS)
    if unknown:
        raise ValueError(f"unknown evidence {sorted(unknown)}; options: {', '.join(NEEDS)}")
    if (where == "layers") != (schedule is not None):
        raise ValueError("a 'layers' method needs a schedule, and only a 'layers' method has one")
    if layer is not None and where != "layer":
        raise ValueError("only a 'layer' method has a default layer")
    if schedule_ratio and schedule is None:
        raise ValueError("schedule_ratio=True needs a schedule")

    def decorator(fn: Selector) -> Selector:
        _add(
            MethodInfo(
                name,
                where,
                fn,
                frozenset(needs),
                summary,
                source,
                schedule,
                schedule_ratio=schedule_ratio,
                layer=layer,
                check_knobs=check_knobs,
                keeps=keeps,
            )
        )
        return fn

    return decorator


def _rule_selector(rule: Rule, inputs: StageInputs) -> Selection:
    """The ``inputs.budget`` highest scores of ``rule`` (paper Eq. (8) for PriorTR)."""
    scores = rule(inputs.attention)
    return Selection(indices=select_top_k(scores, inputs.budget), scores=scores)


def register_rule(
    name: str, *, summary: str, source: str, layer: int | None = None
) -> Callable[[Rule], Rule]:
    """Decorator registering a scoring rule as a one-layer method keeping its top-K scores;
    ``layer``: its default scored layer (``MethodInfo.layer``)."""

    def decorator(fn: Rule) -> Rule:
        selector = partial(_rule_selector, fn)
        needs = frozenset({"attention"})
        _add(MethodInfo(name, "layer", selector, needs, summary, source, rule=fn, layer=layer))
        return fn

    return decorator


def get_method(name: str) -> MethodInfo:
    """Look up a method by name; an unknown name raises ValueError listing the options."""
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}") from None


def get_rule(name: str) -> MethodInfo:
    """Look up a method registered as a scoring rule (its ``rule`` is set); others raise ValueError."""
    info = _METHODS.get(name)
    if info is None or info.rule is None:
        raise ValueError(f"unknown scoring rule {name!r}; available: {', '.join(available_rules())}")
    return info


def available_methods() -> list[str]:
    """Names of every registered method, scoring rules included, sorted."""
    return sorted(_METHODS)


def available_rules() -> list[str]:
    """Names of the methods registered as scoring rules, sorted."""
    return sorted(name for name, info in _METHODS.items() if info.rule is not None)
