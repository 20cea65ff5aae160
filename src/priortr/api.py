"""``priortr.apply``: attach visual-token pruning to a stock transformers model, and take it off again."""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from os import PathLike
from typing import Any

from torch import nn

from priortr.adapters import adapter_for
from priortr.engine import (
    BEFORE_LLM,
    DEFAULT_LAYER,
    HEAD_AGGREGATIONS,
    POSTERIOR_ROWS,
    VISION_NEEDS,
    PruneResult,
    PruningConfig,
    PruningEngine,
)
from priortr.engine.pools import MULTI_IMAGE
from priortr.methods import MethodInfo, get_method
from priortr.methods.scoring import resolve_budget
from priortr.tools import config_file

_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
DEFAULT_BUDGET = 64


class PruningHandle:
    """Pruning attached to one model. ``remove()`` (or leaving a ``with`` block) restores it exactly.

    ``last`` holds what the most recent pruned prefill kept and why (a ``PruneResult``), or None
    before the first one.

    A call that carries more than its prompt (``generate(use_cache=False)``, assisted decoding, an
    answer scored in one call inside ``prompt_ends``) prunes as cached decoding does: the kept set is
    decided by the prompt alone and what follows runs on the kept tokens in every layer, so it gives
    what cached, pruned greedy decoding gives (docs/robustness.md).
    """

    def __init__(self, engine: PruningEngine) -> None:
        self._engine = engine

    @property
    def config(self) -> PruningConfig:
        return self._engine.config

    @property
    def last(self) -> PruneResult | None:
        return self._engine.last

    @property
    def attached(self) -> bool:
        """False once ``remove()`` ran (leaving a ``with`` block included)."""
        return self._engine.attached

    def remove(self) -> None:
        """Detach every hook; the model computes exactly what it did before ``apply``. Caches pruned
        under this handle refuse to continue on the stock model; a new ``apply`` continues them."""
        self._engine.detach()
        if _ATTACHED.get(self._engine.model) is self:
            del _ATTACHED[self._engine.model]

    def prompt_ends(self, at: int) -> AbstractContextManager[None]:
        """Within this block, a call of the model (in this thread) holds its prompt, the image(s) and
        the instruction, in its first ``at`` columns, and a continuation after them: an answer appended
        to its question to score it, say. Lay a batch out with the prompts padded on the left and the
        continuations on the right, so that every prompt ends at column ``at``.

        Such a call prunes as cached decoding does: the kept set is decided by the prompt alone (what a
        prefill of the prompt keeps, whatever follows), and the continuation runs on the kept tokens
        in every layer, so its logits are those that cached, pruned decoding gives it, token by token.
        The call runs as two passes for that (a prefill of the prompt, then the continuation on its
        cache), and returns one output, the prompt's kept rows followed by the continuation's;
        ``handle.last`` describes the prompt's prefill. Without the block a call is all prompt, and a
        continuation in it would count as instruction. ``generate()`` sets it itself (its input is the
        prompt), so ``use_cache=False`` and assisted decoding give what cached decoding gives::

            with handle.prompt_ends(at=prompt["input_ids"].shape[1]):
                logits = model(**prompt_and_answer, use_cache=False).logits  # [B, S' + T, V]
        """
        if not _is_int(at) or at < 1:
            raise ValueError(f"at must be the prompt's column count, an int >= 1; got {at!r}")
        return self._engine.prompt_ends(at)

    def __enter__(self) -> PruningHandle:
        if not self.attached:
            raise ValueError(
                "this handle was removed, so a with block on it would run the model unpruned; "
                "call priortr.apply(model, ...) again for a new handle"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def apply(
    model: nn.Module,
    method: str = "priortr",
    budget: int | float | None = None,
    layer: int | None = None,
    *,
    stages: Sequence[tuple[int, int | float]] | None = None,
    options: Mapping[str, Any] | None = None,
    heads: str = "mean",
    posterior_rows: str = "after_separator",
    separator_offset: int = 0,
    multi_image: str = "per_image",
    strict: bool = False,
    seed: int = 0,
    config: str | PathLike[str] | None = None,
) -> PruningHandle:
    """Prune visual tokens of ``model`` in every prefill from now on.

    Args:
        model: a supported ``*ForConditionalGeneration`` (see ``priortr.supported_model_types()``).
        method: a method by name (``priortr.available_methods()``, ``priortr methods``); ``priortr`` is
            the paper's Eq. (8), P * log((P + eps) / (Q + eps)).
        budget: visual tokens kept per prompt: an int count K, or a ratio in (0, 1) of each image's
            (or video's) tokens; 64 when not given. A prompt with several images splits a count over
            them in proportion to their token counts. A budget covering every token leaves outputs
            bit-identical to the stock model.
        layer: for one-layer methods, the 0-indexed decoder layer that is scored, in
            [0, num_layers - 2] (default: the method's published setting, 1 for FastV's K = 2 and
            DART's ``pruned_layer 2``, else 2); layers ``layer + 1 ..`` run on the kept tokens and the KV
            cache of layers ``0 .. layer`` is pruned. Methods that prune before the language model or
            follow their own schedule take no layer.
        stages: (scored layer, budget) pairs, layers increasing, budgets not increasing, that replace
            a decoder-layer method's stages (e.g. PriorTR in a custom multi-stage schedule); they set
            every layer and budget, so ``budget`` and ``layer`` must then be left unset.
        options: the method's knobs by name (``priortr methods`` lists them with their defaults).
        heads: head aggregation of attention, ``mean`` (paper) or ``max``.
        posterior_rows: rows averaged into P: ``after_separator`` (every prompt token after the
            separator), ``from_separator`` (the separator too), or ``last``.
        separator_offset: the prior is read this many tokens after the first post-image token.
        multi_image: ``per_image`` (each image or video ranked alone, its Q and P normalised over its
            own tokens, under its share of the budget) or ``global`` (a prompt's images ranked
            together under one budget; ``priortr.engine.pools``).
        strict: raise instead of warning when a prompt has nothing to prune.
        seed: seed of random choices (the ``random`` rule, K-means initialisation).
        config: a config file (``priortr.tools.config_file``, written by ``priortr calibrate``) whose keywords
            replace the defaults above; a keyword passed here and set differently in the file is refused.
    """
    if config is not None:
        given = {name: value for name, value in locals().items() if name not in ("model", "config")}
        return apply(model, **config_file.merge(config, given))
    adapter = adapter_for(model)
    try:
        n_layers = len(adapter.decoder_layers(model))
        adapter.multimodal_model(model)
    except AttributeError as error:
        raise ValueError(
            f"pass the *ForConditionalGeneration model (the one with generate()); this "
            f"{type(model).__name__} lacks its parts ({error})"
        ) from error
    info = get_method(method)
    if info.needs & VISION_NEEDS and adapter.vision_probe(model) is None:
        raise ValueError(
            f"{method} ranks by the vision tower's [CLS] attention, and this {adapter.name} model's vision "
            "tower has no [CLS] token; use a method that needs none (divprune, dart, or an in-LLM method)"
        )
    if model in _ATTACHED:
        raise ValueError(
            "this model already has priortr attached; call .remove() on that handle first, "
            "or priortr.detach(model) if you no longer have it"
        )
    config = pruning_config(
        method,
        budget,
        layer,
        n_layers=n_layers,
        stages=stages,
        options=options,
        heads=heads,
        posterior_rows=posterior_rows,
        separator_offset=separator_offset,
        multi_image=multi_image,
        strict=strict,
        seed=seed,
    )
    _check_injection(config, adapter.injected_layers(model), n_layers)
    _check_scored_layers(config, adapter.attention_layers(model), n_layers)
    engine = PruningEngine(model, adapter, config)
    engine.attach()
    handle = PruningHandle(engine)
    _ATTACHED[model] = handle
    return handle


def pruning_config(
    method: str = "priortr",
    budget: int | float | None = None,
    layer: int | None = None,
    *,
    n_layers: int,
    stages: Sequence[tuple[int, int | float]] | None = None,
    options: Mapping[str, Any] | None = None,
    heads: str = "mean",
    posterior_rows: str = "after_separator",
    separator_offset: int = 0,
    multi_image: str = "per_image",
    strict: bool = False,
    seed: int = 0,
) -> PruningConfig:
    """The checked ``PruningConfig`` of :func:`apply`'s settings for a language model of ``n_layers``
    decoder layers; every front end (``apply``, the vLLM plug-in) validates through here, so a bad
    setting gets the same message everywhere."""
    info = get_method(method)
    if stages is not None and (budget is not None or layer is not None):
        given = ", ".join(
            f"{name}={value!r}" for name, value in (("budget", budget), ("layer", layer)) if value is not None
        )
        raise ValueError(
            f"stages= sets the layer and budget of every stage, so it conflicts with {given}; "
            "pass either stages or budget/layer"
        )
    budget = DEFAULT_BUDGET if budget is None else budget
    resolve_budget(budget, n_visual=1 << 30)  # validates type and range before any forward pass
    layer = _check_layer(info, layer, n_layers)
    stages = _check_stages(info, stages, n_layers)
    options = _check_options(info, options)
    if heads not in HEAD_AGGREGATIONS:
        raise ValueError(f"heads must be one of {', '.join(HEAD_AGGREGATIONS)}; got {heads!r}")
    if posterior_rows not in POSTERIOR_ROWS:
        raise ValueError(f"posterior_rows must be one of {', '.join(POSTERIOR_ROWS)}; got {posterior_rows!r}")
    if isinstance(separator_offset, bool) or not isinstance(separator_offset, int) or separator_offset < 0:
        raise ValueError(f"separator_offset must be an int >= 0; got {separator_offset!r}")
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be True or False; got {strict!r}")
    if not _is_int(seed):
        raise ValueError(f"seed must be an int; got {seed!r}")
    if multi_image not in MULTI_IMAGE:
        raise ValueError(f"multi_image must be one of {', '.join(MULTI_IMAGE)}; got {multi_image!r}")
    return PruningConfig(
        method=info,
        budget=budget,
        layer=layer,
        stages=stages,
        options=options,
        heads=heads,
        posterior_rows=posterior_rows,
        separator_offset=separator_offset,
        multi_image=multi_image,
        strict=strict,
        seed=seed,
    )


def detach(model: nn.Module) -> bool:
    """Remove whatever pruning is attached to ``model`` (as its handle's ``remove()`` would), also when
    that handle was dropped; return whether something was attached."""
    handle = _ATTACHED.get(model)
    if handle is None:
        return False
    handle.remove()
    return True


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_layer(info: MethodInfo, layer: int | None, n_layers: int) -> int:
    if info.where != "layer":
        if layer is not None:
            where = "before the language model" if info.where == "vision" else "on its own schedule of layers"
            raise ValueError(f"{info.name} prunes {where}; it takes no layer (leave layer=None)")
        return DEFAULT_LAYER
    if layer is None:
        layer = info.default_layer
    if not _is_int(layer) or not 0 <= layer <= n_layers - 2:
        raise ValueError(
            f"layer must be an int in [0, {n_layers - 2}] for this {n_layers}-layer model "
            f"(the scored layer must have a layer after it); got {layer!r}"
        )
    return layer


def _check_injection(config: PruningConfig, injected: int, n_layers: int) -> None:
    """Refuse stages that would prune while the model still adds visual features to the hidden states
    (Qwen3-VL's DeepStack injects into the outputs of its first ``injected`` layers)."""
    if injected == 0:
        return
    first = min(layer for layer, _ in config.plan(1 << 20, n_layers))
    if first < injected - 1:
        where = "before the language model" if first == BEFORE_LLM else f"after layer {first}"
        raise ValueError(
            f"this model adds visual features to the outputs of decoder layers 0..{injected - 1} "
            "(DeepStack), "
            f"so {config.method.name} cannot prune {where}; score layer {injected - 1} or later"
        )


def _check_scored_layers(config: PruningConfig, attention: list[int], n_layers: int) -> None:
    """Refuse stages whose evidence needs attention rows at a layer without softmax attention (Qwen3.5's
    linear-attention layers have a recurrent state, no attention matrix): the scored layer itself
    (``attention``, ``keys``) or the one after it (``next_attention``)."""
    offset = 1 if "next_attention" in config.method.needs else 0
    if not config.method.needs & {"attention", "keys", "next_attention"} or len(attention) == n_layers:
        return
    for layer, _ in config.plan(1 << 20, n_layers):
        if layer == BEFORE_LLM or layer + offset in attention:
            continue
        allowed = [index - offset for index in attention if 0 <= index - offset <= n_layers - 2]
        nearest = min(allowed, key=lambda index: (abs(index - layer), index), default=None)
        which = "the layer after the scored one" if offset else "the scored layer"
        raise ValueError(
            f"{config.method.name} reads attention at {which}, and decoder layer {layer + offset} of this "
            f"model has no softmax attention (only layers {attention} do); "
            + (
                f"score layer {nearest} instead"
                if nearest is not None
                else "no layer of this model can be scored"
            )
        )


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
    if not all(_is_int(layer) and 0 <= layer <= n_layers - 2 for layer in layers) or layers != sorted(
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


def _check_options(info: MethodInfo, options: Mapping[str, Any] | None) -> dict[str, Any]:
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(f"options must be a dict of the method's knobs by name; got {options!r}")
    options = dict(options or {})
    unknown = sorted(set(options) - set(info.knobs))
    if unknown:
        known = ", ".join(f"{name}={default!r}" for name, default in info.knobs.items()) or "none"
        raise ValueError(f"{info.name} has no option {', '.join(unknown)}; its options: {known}")
    return options
