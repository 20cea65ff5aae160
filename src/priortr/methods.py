"""The registry of pruning methods: what each one reads, where it prunes, and the paper it comes from.

A method is a selector (a pure tensor function ``StageInputs -> Selection``, ``priortr.selection``)
plus where it acts: ``vision`` (on the visual tokens before the language model, from vision-tower
evidence), ``layer`` (after one decoder layer, from that layer's attention or hidden states) or
``layers`` (several decoder layers, a schedule of stages). Every scoring rule of
``priortr.scoring`` is a ``layer`` method that keeps its top-K scores. The engine runs any method
through the same hooks, so they are compared on the same model, budget and harness.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from priortr.scoring import Evidence, available_rules, get_rule
from priortr.selection import Selection, StageInputs, top_k
from priortr.selectors import diversity, merging

WHERE = ("vision", "layer", "layers")
NEEDS = ("attention", "text_rows", "vision")

Selector = Callable[..., Selection]
Schedule = Callable[[int, int, int, int], list[tuple[int, int]]]
"""(K, N, layer, n_layers) -> [(0-indexed scored layer, visual tokens kept after it), ...]."""


@dataclass(frozen=True)
class MethodInfo:
    """A registered pruning method.

    Attributes:
        name: the name ``priortr.apply`` and ``--method`` accept.
        where: ``vision``, ``layer`` or ``layers`` (see the module docstring).
        select: the selector; its keyword-only parameters are the method's knobs.
        needs: evidence the engine must gather: ``attention`` (prior, posterior, last row at the scored
            layer), ``text_rows`` (each instruction row over the visual tokens, with ``attention``)
            and/or ``vision`` (the vision tower's [CLS] attention and keys).
        schedule: the stages of a ``layers`` method; None runs one stage.
        summary, source: one line each for ``priortr methods`` and the README.
    """

    name: str
    where: str
    select: Selector
    needs: frozenset[str]
    summary: str
    source: str
    schedule: Schedule | None = None

    @property
    def knobs(self) -> dict[str, object]:
        """The selector's keyword-only parameters and their defaults."""
        parameters = inspect.signature(self.select).parameters.values()
        return {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


_METHODS: dict[str, MethodInfo] = {}


def register_method(
    name: str,
    *,
    where: str,
    needs: tuple[str, ...] = (),
    summary: str,
    source: str,
    schedule: Schedule | None = None,
) -> Callable[[Selector], Selector]:
    """Decorator adding a selector to the registry under ``name``; a duplicate name raises ValueError."""
    if where not in WHERE:
        raise ValueError(f"where must be one of {', '.join(WHERE)}; got {where!r}")
    unknown = set(needs) - set(NEEDS)
    if unknown:
        raise ValueError(f"unknown evidence {sorted(unknown)}; options: {', '.join(NEEDS)}")
    if (where == "layers") != (schedule is not None):
        raise ValueError("a 'layers' method needs a schedule, and only a 'layers' method has one")

    def decorator(fn: Selector) -> Selector:
        if name in _METHODS or name in available_rules():
            raise ValueError(f"method {name!r} is already registered")
        _METHODS[name] = MethodInfo(name, where, fn, frozenset(needs), summary, source, schedule)
        return fn

    return decorator


def _rule_selector(rule: Callable[[Evidence], object], inputs: StageInputs) -> Selection:
    return top_k(rule(inputs.attention), inputs.budget)


def get_method(name: str) -> MethodInfo:
    """Look up a method by name; a scoring rule is a one-layer top-K method. Unknown names raise."""
    if name in _METHODS:
        return _METHODS[name]
    if name in available_rules():
        rule = get_rule(name)
        return MethodInfo(
            name,
            "layer",
            partial(_rule_selector, rule.fn),
            frozenset({"attention"}),
            rule.summary,
            rule.source,
        )
    raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}")


def available_methods() -> list[str]:
    """Names of every method: the registered selectors and the scoring rules, sorted."""
    return sorted({*_METHODS, *available_rules()})


def pyramid_stages(kept: int, n_visual: int, n_layers: int, stages: int = 4) -> list[tuple[int, int]]:
    """PyramidDrop's schedule (Xing et al., CVPR 2025): the decoder split into ``stages`` equal stages
    (layers 8 / 16 / 24 of 32 start stages 2-4), each keeping a ratio lambda of the previous stage's
    visual tokens, lambda = (K / N)^(1 / (stages - 1)) so that the last stage keeps K.

    Returns (0-indexed scored layer, tokens kept after it): the last layer of each stage is scored.
    """
    if stages < 2:
        raise ValueError("PyramidDrop needs at least 2 stages")
    kept = min(kept, n_visual)
    ratio = (kept / n_visual) ** (1 / (stages - 1))
    firsts = [n_layers * i // stages for i in range(1, stages)]
    counts = [round(n_visual * ratio**i) for i in range(1, stages - 1)] + [kept]
    return [(first - 1, count) for first, count in zip(firsts, counts, strict=True)]


def _pyramid(kept: int, n_visual: int, layer: int, n_layers: int) -> list[tuple[int, int]]:
    return pyramid_stages(kept, n_visual, n_layers)


def _sparsevlm(kept: int, n_visual: int, layer: int, n_layers: int) -> list[tuple[int, int]]:
    return merging.sparsevlm_stages(kept, n_visual, n_layers)


@register_method(
    "pdrop",
    where="layers",
    needs=("attention",),
    schedule=_pyramid,
    summary="PyramidDrop: last instruction token's attention, several stages of geometric decay",
    source="PyramidDrop, Xing et al., CVPR 2025",
)
def _pdrop(inputs: StageInputs) -> Selection:
    """Each stage keeps the visual tokens the last instruction token attends to most."""
    return top_k(inputs.attention.last, inputs.budget)


@register_method(
    "pdrop+priortr",
    where="layers",
    needs=("attention",),
    schedule=_pyramid,
    summary="PriorTR's score P*log(P/Q) at every stage of PyramidDrop's schedule",
    source="PriorTR (orthogonal to attention pruners, Sec. 1) in PyramidDrop's schedule (CVPR 2025)",
)
def _pdrop_priortr(inputs: StageInputs) -> Selection:
    """PyramidDrop's stages, each ranked by the prior-corrected score of Eq. (8)."""
    return top_k(get_rule("priortr").fn(inputs.attention), inputs.budget)


register_method(
    "divprune",
    where="vision",
    summary="max-min diversity over the visual tokens' embeddings",
    source="DivPrune, Alvar et al., CVPR 2025",
)(diversity.divprune)
register_method(
    "vispruner",
    where="vision",
    needs=("vision",),
    summary="important tokens by [CLS] attention plus diverse tokens by de-duplication",
    source="VisPruner, Zhang et al., ICCV 2025",
)(diversity.vispruner)
register_method(
    "dart",
    where="layer",
    summary="tokens least duplicated with a few pivot tokens, at the scored layer",
    source="DART, Wen et al., EMNLP 2025 (arXiv 2502.11494)",
)(diversity.dart)
register_method(
    "visionzip",
    where="vision",
    needs=("vision",),
    summary="dominant tokens by [CLS] attention plus contextual tokens merged by key similarity",
    source="VisionZip, Yang et al., CVPR 2025",
)(merging.visionzip)
register_method(
    "prumerge",
    where="vision",
    needs=("vision",),
    summary="[CLS]-attention selection, each kept token absorbing its nearest neighbours",
    source="LLaVA-PruMerge, Shang et al., ICCV 2025",
)(merging.prumerge)
register_method(
    "sparsevlm",
    where="layers",
    needs=("attention", "text_rows"),
    schedule=_sparsevlm,
    summary="attention of text raters, with pruned tokens recycled by clustering and merging",
    source="SparseVLM, Zhang et al., ICML 2025",
)(merging.sparsevlm)
register_method(
    "priortr+merge",
    where="layer",
    needs=("attention",),
    summary="PriorTR ranking; the best pruned tokens clustered (K-means) and merged",
    source="PriorTR, Appendix 'PriorTR+Merging Variant'",
)(merging.priortr_merge)
