"""``priortr.apply``: attach visual-token pruning to a stock transformers model, and take it off again."""

from __future__ import annotations

import weakref

from torch import nn

from priortr.adapters import adapter_for
from priortr.engine import HEAD_AGGREGATIONS, POSTERIOR_ROWS, PruneResult, PruningConfig, PruningEngine
from priortr.scoring import get_rule, resolve_budget

_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PruningHandle:
    """Pruning attached to one model. ``remove()`` (or leaving a ``with`` block) restores it exactly.

    ``last`` holds what the most recent pruned prefill kept and why (a ``PruneResult``), or None
    before the first one.
    """

    def __init__(self, engine: PruningEngine) -> None:
        self._engine = engine

    @property
    def config(self) -> PruningConfig:
        return self._engine.config

    @property
    def last(self) -> PruneResult | None:
        return self._engine.last

    def remove(self) -> None:
        """Detach every hook; the model computes exactly what it did before ``apply``."""
        self._engine.detach()
        if _ATTACHED.get(self._engine.model) is self:
            del _ATTACHED[self._engine.model]

    def __enter__(self) -> PruningHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def apply(
    model: nn.Module,
    method: str = "priortr",
    budget: int | float = 64,
    layer: int = 2,
    *,
    heads: str = "mean",
    posterior_rows: str = "after_separator",
    separator_offset: int = 0,
    strict: bool = False,
    seed: int = 0,
) -> PruningHandle:
    """Prune visual tokens of ``model`` in every prefill from now on.

    Args:
        model: a supported ``*ForConditionalGeneration`` (see ``priortr.supported_model_types()``).
        method: a scoring rule by name (``priortr.available_methods()``); ``priortr`` is the paper's Eq. (8),
            P * log((P + eps) / (Q + eps)).
        budget: visual tokens kept per image: an int count K, or a ratio in (0, 1) of the image's
            tokens. A budget covering every token leaves outputs bit-identical to the stock model.
        layer: 0-indexed decoder layer whose attention is scored, in [0, num_layers - 2]; layers
            ``layer + 1 ..`` run on the kept tokens and the KV cache of layers ``0 .. layer`` is pruned.
        heads: head aggregation, ``mean`` (paper) or ``max``.
        posterior_rows: rows averaged into P: ``after_separator`` (every prompt token after the
            separator), ``from_separator`` (the separator too), or ``last``.
        separator_offset: the prior is read this many tokens after the first post-image token.
        strict: raise instead of warning when a prompt has nothing to prune.
        seed: seed of the ``random`` rule.
    """
    adapter = adapter_for(model)
    rule = get_rule(method)
    resolve_budget(budget, n_visual=1 << 30)  # validates type and range before any forward pass
    n_layers = len(adapter.decoder_layers(model))
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n_layers - 2:
        raise ValueError(
            f"layer must be an int in [0, {n_layers - 2}] for this {n_layers}-layer model "
            f"(the scored layer must have a layer after it); got {layer!r}"
        )
    if heads not in HEAD_AGGREGATIONS:
        raise ValueError(f"heads must be one of {', '.join(HEAD_AGGREGATIONS)}; got {heads!r}")
    if posterior_rows not in POSTERIOR_ROWS:
        raise ValueError(f"posterior_rows must be one of {', '.join(POSTERIOR_ROWS)}; got {posterior_rows!r}")
    if isinstance(separator_offset, bool) or not isinstance(separator_offset, int) or separator_offset < 0:
        raise ValueError(f"separator_offset must be an int >= 0; got {separator_offset!r}")
    if model in _ATTACHED:
        raise ValueError("this model already has priortr attached; call .remove() on that handle first")
    config = PruningConfig(
        rule=rule,
        budget=budget,
        layer=layer,
        heads=heads,
        posterior_rows=posterior_rows,
        separator_offset=separator_offset,
        strict=strict,
        seed=seed,
    )
    engine = PruningEngine(model, adapter, config)
    engine.attach()
    handle = PruningHandle(engine)
    _ATTACHED[model] = handle
    return handle
