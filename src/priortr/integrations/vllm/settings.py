"""What a served model prunes: the engine-wide ``priortr`` settings of its config, and a request's own.

The engine-wide settings ride in the model's Hugging Face config under ``priortr`` (vLLM's
``--hf-overrides '{"priortr": {...}}'`` / ``LLM(..., hf_overrides=...)``) and take the keywords of
``priortr.apply``; a request may change its budget or turn pruning off through
``mm_processor_kwargs={"priortr": {"budget": 32}}`` / ``{"priortr": {"enabled": false}}``. Both are
checked by the library's own ``PruningConfig.of``, so a bad setting reads as it does for ``apply``.

What a request may set is the operator's choice (``RequestPolicy``): vLLM's server takes request
``mm_processor_kwargs`` and ``media_io_kwargs`` only under ``--trust-request-mm-kwargs``, which opens
every Hugging Face processor keyword and every media-loading keyword; a served pruning model accepts
``priortr`` alone in ``mm_processor_kwargs`` (plus the keywords the operator lists in
``request_processor_kwargs``), no ``media_io_kwargs`` of its own (but those the operator lists in
``request_media_io_kwargs``), and a budget other than the engine's only where the operator lists it
in ``request_budgets`` (default deny: the budgets clients may pick, and so the smallest K a request
may bring, are the operator's choice; docs/serving.md, Security). Turning pruning off is always
allowed: it costs what a request on stock vLLM costs.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from priortr.engine.config import VISION_NEEDS, PruningConfig, resolve_budget

SETTINGS_KEY = "priortr"
"""The key of the settings in the model's config and in a request's ``mm_processor_kwargs``."""

CONFIG_KEYS = frozenset(
    {"method", "budget", "layer", "stages", "options", "heads", "posterior_rows", "separator_offset", "seed"}
)
POLICY_KEYS = frozenset({"request_budgets", "request_processor_kwargs", "request_media_io_kwargs"})
ENGINE_KEYS = CONFIG_KEYS | POLICY_KEYS
REQUEST_KEYS = frozenset({"budget", "enabled"})
SERVED_EVIDENCE = frozenset({"attention", "text_rows", "next_attention", "input_embeddings", "grid"})
"""Evidence the plug-in gathers at a scored layer: the recomputed attention rows of that layer or of
the layer after it, the prompt's input of layer 0 and each image's grid."""
TOP_K_SCHEDULES = frozenset({"clse", "pdrop", "pdrop+priortr"})
"""Methods with a schedule of their own that keep each stage's top-K tokens and merge none (read in
their selectors, ``priortr.methods.clse`` / ``pdrop``); SparseVLM recycles pruned tokens as merges."""
STEP_LIMIT_KEY = "priortr_step_tokens"
"""The model config's attribute holding the longest prompt the engine schedules in one step, set by
the config hook (``config_hooks.step_limit``): a pruned prompt's prefill is one step."""
WHOLE_LIMIT_KEY = "priortr_whole_prompt_tokens"
"""The model config's attribute holding the most tokens of whole (unpruned) prompts one step runs
through layers 0..L, set by the config hook (``config_hooks.whole_prompt_limit``): the scheduler's
token budget, which vLLM's start-up memory profile runs through every layer (``scheduler.py``)."""


@dataclass(frozen=True)
class ServedSettings:
    """A served model's checked ``priortr`` settings: the engine-wide ``config`` and the ``policy`` of
    what a request may set (both immutable, so every caller may share them)."""

    config: PruningConfig
    policy: RequestPolicy


_CHECKED: dict[Hashable, ServedSettings] = {}
"""``served_settings``' cache: the checked settings by (settings' contents, decoder layers)."""


def served_settings(hf_config: Any) -> ServedSettings | None:
    """The checked settings of a model config, or None when it carries none (stock vLLM).

    Checked once per served config (its settings and depth) and then read from a cache: the config
    hooks, the model, and the processor on every request all ask. The cache is keyed by the settings'
    contents (``_contents``), read afresh at every call, so a config whose settings changed is checked
    again; a refused config is never cached, so it is refused at every call."""
    settings = getattr(hf_config, SETTINGS_KEY, None)
    if settings is None:
        return None
    n_layers = hf_config.get_text_config().num_hidden_layers
    try:
        key = (_contents(settings), n_layers)
    except TypeError:  # a value that cannot key a cache (a set of lists...): checked at every call
        return check_settings(settings, n_layers)
    served = _CHECKED.get(key)
    if served is None:
        served = _CHECKED[key] = check_settings(settings, n_layers)
    return served


def _contents(value: object) -> Hashable:
    """A hashable copy of a settings value that tells apart what the checks tell apart: mappings and
    lists by their items, each other value by its type and value (1, 1.0 and True are equal keys in
    Python, and not to the checks); raises TypeError for a value that cannot be hashed."""
    if isinstance(value, Mapping):
        return (Mapping, tuple((_contents(key), _contents(item)) for key, item in value.items()))
    if isinstance(value, list | tuple):
        return (type(value), tuple(_contents(item) for item in value))
    hash(value)
    return (type(value), value)


def engine_config(settings: object, n_layers: int) -> PruningConfig:
    """The checked ``PruningConfig`` of a config's ``priortr`` settings, for ``n_layers`` decoder layers
    (``check_settings``: the request policy is checked too)."""
    return check_settings(settings, n_layers).config


def check_settings(settings: object, n_layers: int) -> ServedSettings:
    """The checked config and request policy of a config's ``priortr`` settings, for ``n_layers``
    decoder layers.

    Methods served are the one-layer methods ranking from a scored layer's attention with plain top-K
    pruning (PriorTR, FastV and the other scoring rules), ``stages`` schedules of them, CLSE and
    PyramidDrop, and the methods pruning before the language model from the vision tower's evidence or
    the input embeddings (VisionZip, VisPruner, DivPrune, PruMerge(+) where the tower shows its last
    layer; the model refuses a tower that does not show what one reads when it loads); the rest are
    refused with the reason."""
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
    config = PruningConfig.of(n_layers=n_layers, **{k: v for k, v in settings.items() if k in CONFIG_KEYS})
    check_served(config)
    policy = request_policy(settings)
    if policy.budgets and (config.stages is not None or config.method.schedule is not None):
        raise ValueError(
            f"{config.method.name} prunes at several layers, whose counts the step plans from the engine's "
            "budget (a request's budget reaches it only as its last stage's slots); serve its requests at "
            'the engine\'s budget: drop "request_budgets"'
        )
    return ServedSettings(config, policy)


@dataclass(frozen=True)
class RequestPolicy:
    """What a request may set on a served pruning model: ``budgets``, the budgets it may ask for
    besides the engine's (none unless listed), ``processor_kwargs``, the Hugging Face processor
    keywords it may pass beside ``priortr``, and ``media_io_kwargs``, the media-loading keywords it
    may pass, each named ``"modality.keyword"`` (``"video.num_frames"``)."""

    budgets: tuple[int | float, ...] = ()
    processor_kwargs: frozenset[str] = frozenset()
    media_io_kwargs: frozenset[str] = frozenset()


def request_policy(settings: Mapping[str, Any]) -> RequestPolicy:
    """The checked request policy of a config's ``priortr`` settings."""
    budgets = settings.get("request_budgets")
    if budgets is not None:
        if not isinstance(budgets, list | tuple) or not budgets:
            raise ValueError(f"request_budgets must be a list of budgets (counts or ratios); got {budgets!r}")
        for budget in budgets:
            resolve_budget(budget, n_visual=1 << 30)  # the library's check of a count or a ratio
    keywords = settings.get("request_processor_kwargs", [])
    if not isinstance(keywords, list | tuple) or not all(isinstance(k, str) for k in keywords):
        raise ValueError(f"request_processor_kwargs must be a list of keyword names; got {keywords!r}")
    media = settings.get("request_media_io_kwargs", [])
    if not isinstance(media, list | tuple) or not all(
        isinstance(k, str) and len(k.split(".")) == 2 and all(k.split(".")) for k in media
    ):
        raise ValueError(
            'request_media_io_kwargs must be a list of "modality.keyword" names, e.g. '
            f'["video.num_frames"]; got {media!r}'
        )
    return RequestPolicy(tuple(budgets or ()), frozenset(keywords), frozenset(media))


def check_request_kwargs(
    merged: Mapping[str, object], engine_defaults: Mapping[str, object], policy: RequestPolicy
) -> None:
    """Refuse processor keywords a request set (``merged``: the engine's ``--mm-processor-kwargs``
    with the request's over them) that ``policy`` does not grant it."""
    requested = {key for key, value in merged.items() if engine_defaults.get(key, _UNSET) != value}
    refused = sorted(requested - {SETTINGS_KEY} - policy.processor_kwargs)
    if refused:
        raise ValueError(
            f"this server accepts only {SETTINGS_KEY!r} in a request's mm_processor_kwargs; got "
            f"{', '.join(refused)} (the operator may set them for every request with --mm-processor-kwargs, "
            f'or grant them with "request_processor_kwargs" in the priortr settings)'
        )


def check_request_media(
    requested: Mapping[str, Mapping[str, object]],
    engine_defaults: Mapping[str, Mapping[str, object]],
    policy: RequestPolicy,
) -> None:
    """Refuse media-loading keywords a request set (``requested``: vLLM's per-modality
    ``media_io_kwargs`` of the request, merged over the engine's ``--media-io-kwargs`` where vLLM's
    server merges them) that differ from the engine's and that ``policy`` does not grant."""
    changed = {
        f"{modality}.{key}"
        for modality, keywords in requested.items()
        for key, value in (keywords or {}).items()
        if (engine_defaults.get(modality) or {}).get(key, _UNSET) != value
    }
    refused = sorted(changed - policy.media_io_kwargs)
    if refused:
        raise ValueError(
            f"this server accepts no media_io_kwargs from a request; got {', '.join(refused)} (the "
            "operator may set them for every request with --media-io-kwargs, or grant chosen ones with "
            f'"request_media_io_kwargs": ["{refused[0]}"] in the priortr settings)'
        )


_UNSET = object()


def check_served(config: PruningConfig) -> None:
    """Refuse a method the plug-in cannot run exactly inside vLLM, saying why."""
    method = config.method
    if method.where == "vision":
        missing = sorted(method.needs - VISION_NEEDS)
        if missing:
            raise ValueError(
                f"{method.name} prunes before the language model by {', '.join(missing)}, which the vLLM "
                "plug-in does not gather (it reads the vision tower's [CLS] attention, keys and features, "
                "and the input embeddings); serve divprune, visionzip, vispruner or a decoder-layer method"
            )
        if dict(config.options).get("adaptive", False):
            raise ValueError(
                f"{method.name} with adaptive=True keeps as many tokens as the tower's [CLS] attention has "
                "outliers, known only once the tower ran, and vLLM lays a request's prompt out before: "
                "serve adaptive=False (the budget's K)"
            )
        return
    missing = sorted(method.needs - SERVED_EVIDENCE)
    if missing:
        raise ValueError(
            f"{method.name} needs {', '.join(missing)} evidence, which the vLLM plug-in does not gather "
            "(it recomputes attention rows and reads the input embeddings and image grids only); serve "
            "priortr, fastv or another scoring rule, clse or pdrop"
        )
    if method.rule is None and method.name not in TOP_K_SCHEDULES:
        raise ValueError(
            f"{method.name} may merge tokens, which the vLLM plug-in does not write into the paged cache; "
            "serve a scoring rule (priortr, fastv, prior, posterior, diff, logratio, entropy, random), "
            "clse or pdrop"
        )


def request_config(
    config: PruningConfig, override: object, policy: RequestPolicy = RequestPolicy()
) -> PruningConfig | None:
    """The settings of one request: ``config`` with the request's ``priortr`` override applied, or
    None when the request turns pruning off; a budget other than the engine's that ``policy`` does
    not list is refused."""
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
    if budget == config.budget:
        return config
    if not policy.budgets:
        raise ValueError(
            f"this server serves its own budget ({config.budget}) and grants requests no other; got "
            f"{budget!r} (the operator lists the budgets a request may ask for with "
            '"request_budgets" in the priortr settings)'
        )
    if budget not in policy.budgets:
        raise ValueError(
            f"this server serves the request budgets {', '.join(map(str, policy.budgets))}; got {budget!r}"
        )
    return replace(config, budget=budget)


def position_limit(model_config: Any) -> int:
    """The positions a served model places: ``max_model_len``, or its text config's
    ``max_position_embeddings`` (the rows of its RoPE table) where that is more. A pruned request's
    cache holds K per image, which vLLM counts against ``max_model_len``; its positions count N."""
    table = getattr(model_config.hf_text_config, "max_position_embeddings", None) or 0
    return max(model_config.max_model_len, table)
