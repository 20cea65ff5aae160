"""What a served model prunes: the engine-wide ``priortr`` settings of its config, and a request's own.

The engine-wide settings ride in the model's Hugging Face config under ``priortr`` (vLLM's
``--hf-overrides '{"priortr": {...}}'`` / ``LLM(..., hf_overrides=...)``) and take the keywords of
``priortr.apply``; a request may change its budget or turn pruning off through
``mm_processor_kwargs={"priortr": {"budget": 32}}`` / ``{"priortr": {"enabled": false}}``. Both are
checked by the library's own ``PruningConfig.of``, so a bad setting reads as it does for ``apply``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from priortr.engine.config import PruningConfig, resolve_budget

SETTINGS_KEY = "priortr"
"""The key of the settings in the model's config and in a request's ``mm_processor_kwargs``."""

ENGINE_KEYS = frozenset(
    {"method", "budget", "layer", "options", "heads", "posterior_rows", "separator_offset", "seed"}
)
REQUEST_KEYS = frozenset({"budget", "enabled"})
SERVED_EVIDENCE = frozenset({"attention", "text_rows"})
"""Evidence the plug-in gathers at the scored layer: the recomputed attention rows."""


def engine_config(settings: object, n_layers: int) -> PruningConfig:
    """The checked ``PruningConfig`` of a config's ``priortr`` settings, for ``n_layers`` decoder layers.

    Methods served are the one-layer methods ranking from the scored layer's attention with plain
    top-K pruning (PriorTR, FastV and the other scoring rules); the rest are refused with the reason."""
    if not isinstance(settings, Mapping):
        raise ValueError(
            f"the model config's {SETTINGS_KEY!r} must be a dict of priortr.apply's keywords, "
            f'e.g. {{"method": "priortr", "budget": 64, "layer": 2}}; got {settings!r}'
        )
    unknown = sorted(set(settings) - ENGINE_KEYS)
    if unknown:
        raise ValueError(
            f"unknown priortr setting(s) {', '.join(unknown)} for vLLM; "
            f"accepted: {', '.join(sorted(ENGINE_KEYS))}"
        )
    config = PruningConfig.of(n_layers=n_layers, **settings)
    check_served(config)
    return config


def check_served(config: PruningConfig) -> None:
    """Refuse a method the plug-in cannot run exactly inside vLLM, saying why."""
    method = config.method
    if method.where == "vision":
        raise ValueError(
            f"{method.name} prunes before the language model from the vision tower's evidence, which the "
            "vLLM plug-in does not gather; serve a decoder-layer method (priortr, fastv, ...)"
        )
    if method.where == "layers" or config.stages is not None:
        raise ValueError(
            f"{method.name} prunes at several decoder layers; the vLLM plug-in prunes after one layer "
            "(each stage would need its own KV rewrite); serve a one-layer method"
        )
    missing = sorted(method.needs - SERVED_EVIDENCE)
    if missing:
        raise ValueError(
            f"{method.name} needs {', '.join(missing)} evidence, which the vLLM plug-in does not gather "
            "(it recomputes the scored layer's attention rows only); serve priortr, fastv or another "
            "scoring rule"
        )
    if method.rule is None:
        raise ValueError(
            f"{method.name} may merge tokens, which the vLLM plug-in does not write into the paged cache; "
            "serve a scoring rule (priortr, fastv, prior, posterior, diff, logratio, entropy, random)"
        )


def request_config(config: PruningConfig, override: object) -> PruningConfig | None:
    """The settings of one request: ``config`` with the request's ``priortr`` override applied, or
    None when the request turns pruning off."""
    if override is None:
        return config
    if not isinstance(override, Mapping):
        raise ValueError(
            f"mm_processor_kwargs {SETTINGS_KEY!r} must be a dict such as "
            f'{{"budget": 32}} or {{"enabled": false}}; got {override!r}'
        )
    unknown = sorted(set(override) - REQUEST_KEYS)
    if unknown:
        raise ValueError(
            f"a request may set only {', '.join(sorted(REQUEST_KEYS))} of priortr; got {', '.join(unknown)} "
            "(method and layer are the engine's: --hf-overrides)"
        )
    enabled = override.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ValueError(f"priortr 'enabled' must be true or false; got {enabled!r}")
    if not enabled:
        return None
    if "budget" not in override:
        return config
    budget: Any = override["budget"]
    resolve_budget(budget, n_visual=1 << 30)  # the library's check of a count or a ratio
    return replace(config, budget=budget)
