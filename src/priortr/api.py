"""``priortr.apply``: attach visual-token pruning to a stock transformers model, and take it off again."""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from os import PathLike
from typing import Any

from torch import nn

from priortr import config_file
from priortr.adapters import adapter_for
from priortr.engine.config import PruningConfig, is_int
from priortr.engine.hooks import PruningEngine
from priortr.engine.prefill import StageObserver
from priortr.engine.result import PruneResult

_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_PARALLEL_WRAPPERS = (nn.DataParallel, nn.parallel.DistributedDataParallel)


def unwrapped(model: nn.Module) -> nn.Module:
    """The model a module wrapper stands for: ``torch.compile``'s ``OptimizedModule`` (``_orig_mod``) and
    (Distributed)DataParallel (``module``) run the model they wrap, so pruning is attached to, and
    refused a second time on, that model whichever of the two is passed. accelerate's hooks wrap a model's
    ``forward`` in place (the model stays the same object), so such a model needs no unwrapping."""
    # An OptimizedModule exists only once torch.compile imported dynamo (importing it here would cost
    # seconds at every apply).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled = getattr(eval_frame, "OptimizedModule", None)
    while True:
        if compiled is not None and isinstance(model, compiled):
            model = model._orig_mod
        elif isinstance(model, _PARALLEL_WRAPPERS):
            model = model.module
        else:
            return model


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
        if not is_int(at) or at < 1:
            raise ValueError(f"at must be the prompt's column count, an int >= 1; got {at!r}")
        return self._engine.prompt_ends(at)

    def observe_stages(self, observer: StageObserver) -> AbstractContextManager[None]:
        """Within this block, ``observer("start", layer)`` and ``observer("end", layer)`` are called
        around all of the work of each stage (evidence, decision, cut, cache compaction, and the kept
        tokens' RoPE and mask for the next layer) of the prefills that start, ``layer`` being the stage's
        scored layer (-1: before the language model). They run on
        the host in the thread that runs the model, between decoder layers ``layer`` and ``layer + 1``
        whatever other hooks the model carries: ``priortr bench`` records its timing marks there. ::

            with handle.observe_stages(lambda event, layer: print(event, layer, time.perf_counter())):
                model(**inputs)
        """
        return self._engine.observe_stages(observer)

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
    posterior_rows: str = "from_separator",
    separator_offset: int = 0,
    multi_image: str = "per_image",
    strict: bool = False,
    seed: int = 0,
    config: str | PathLike[str] | None = None,
) -> PruningHandle:
    """Prune visual tokens of ``model`` in every prefill from now on.

    Args:
        model: a supported ``*ForConditionalGeneration`` (see ``priortr.supported_model_types()``), or a
            wrapper of one (``torch.compile(model)``, DataParallel): pruning attaches to the model it wraps.
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
        posterior_rows: rows averaged into P: ``from_separator`` (the separator and every prompt token
            after it, the paper's rows j >= i_e), ``after_separator`` (the tokens after the separator:
            the default before issue 48), ``from_separator_except_last`` (the separator to the token
            before the last: the authors' Qwen2-VL / Qwen3-VL code), or ``last``.
        separator_offset: the prior is read this many tokens after the first post-image token.
        multi_image: ``per_image`` (each image or video ranked alone, its Q and P normalised over its
            own tokens, under its share of the budget) or ``global`` (a prompt's images ranked
            together under one budget; ``priortr.engine.pools``).
        strict: raise instead of warning when a prompt has nothing to prune.
        seed: seed of random choices (the ``random`` rule, K-means initialisation).
        config: a config file (``priortr.config_file``, written by ``priortr calibrate``) whose keywords
            replace the defaults above; a keyword passed here and set differently in the file is refused.
    """
    settings = {name: value for name, value in locals().items() if name not in ("model", "config")}
    if config is not None:
        return apply(model, **config_file.merge(config, settings, apply_defaults()))
    model = unwrapped(model)
    adapter = adapter_for(model)
    try:
        n_layers = len(adapter.decoder_layers(model))
        adapter.multimodal_model(model)
    except AttributeError as error:
        raise ValueError(
            f"pass the *ForConditionalGeneration model (the one with generate()); this "
            f"{type(model).__name__} lacks its parts ({error})"
        ) from error
    if model in _ATTACHED:
        raise ValueError(
            "this model already has priortr attached; call .remove() on that handle first, "
            "or priortr.detach(model) if you no longer have it"
        )
    config = PruningConfig.of(n_layers=n_layers, **settings)
    config.check_fits(adapter, model, n_layers)
    engine = PruningEngine(model, adapter, config)
    engine.attach()
    handle = PruningHandle(engine)
    _ATTACHED[model] = handle
    return handle


def apply_defaults() -> dict[str, Any]:
    """``apply``'s pruning keywords and their defaults (the model and ``config`` excluded): what a config
    file (``priortr.config_file``) may set."""
    return {
        name: parameter.default
        for name, parameter in inspect.signature(apply).parameters.items()
        if parameter.default is not inspect.Parameter.empty and name != "config"
    }


def detach(model: nn.Module) -> bool:
    """Remove whatever pruning is attached to ``model`` (as its handle's ``remove()`` would), also when
    that handle was dropped (``model`` may be a wrapper of the model, as in ``apply``); return whether
    something was attached."""
    handle = _ATTACHED.get(unwrapped(model))
    if handle is None:
        return False
    handle.remove()
    return True
