"""priortr inside vLLM: visual tokens pruned after decoder layer L of a served model (docs/serving.md).

``register`` is vLLM's ``vllm.general_plugins`` entry point, run in every vLLM process (its CLI
parsing included): on a vLLM release in ``SUPPORTED_VLLM`` it registers the pruning model classes
under vLLM's architecture names of the served families (``architectures.SERVED``), with their
processors and config hooks, and a config hook that refuses ``priortr`` settings on the other families
``priortr.apply`` prunes. A model whose config carries no ``priortr`` settings is built as vLLM's own
class. On any other vLLM, or on any error while registering, it fails closed: it logs one warning and
installs only a guard (``guard.py``) under which an engine whose model config carries ``priortr``
settings refuses to start, naming the reason and the supported range, while stock models and vLLM's
CLI keep working.
"""

from __future__ import annotations

import logging

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_RANGE = ">=0.32,<0.35"
"""The vLLM releases whose internals the plug-in was written and checked against (docs/serving.md)."""
SUPPORTED_VLLM = SpecifierSet(SUPPORTED_RANGE)

logger = logging.getLogger(__name__)


def supported(version: str) -> bool:
    """Whether a vLLM version string (a local or development build included) is in ``SUPPORTED_VLLM``."""
    try:
        return SUPPORTED_VLLM.contains(Version(version).base_version)
    except InvalidVersion:
        return False


def register() -> None:
    """Register the pruning model classes, processors and config hooks with vLLM; where that is not
    possible, install the guard that refuses ``priortr`` configs instead (never raises: vLLM calls
    this in every process, ``vllm --help`` included)."""
    import vllm

    found = getattr(vllm, "__version__", "unknown")
    if not supported(found):
        fail_closed(f"it supports vLLM {SUPPORTED_RANGE} and found {found}")
        return
    try:
        from priortr.integrations.vllm.registration import register_all

        register_all()
    except Exception as error:
        fail_closed(
            f"registering it with vLLM {found} failed with {type(error).__name__}: {error}; it supports "
            f"vLLM {SUPPORTED_RANGE}"
        )


def fail_closed(reason: str) -> None:
    """Install the guard that refuses ``priortr`` configs, logging ``reason`` once; if even the guard
    cannot be installed, log an error saying that such a model would be served unpruned."""
    try:
        from priortr.integrations.vllm.guard import install

        install(reason)
    except Exception as error:
        logger.error(
            "priortr's vLLM plug-in is not active (%s) and could not install its guard (%s: %s): a model "
            "whose config carries priortr settings would be served UNPRUNED; install a supported vLLM "
            "(docs/serving.md)",
            reason,
            type(error).__name__,
            error,
        )
        return
    logger.warning(
        "priortr's vLLM plug-in is not active (%s): an engine whose model config carries priortr "
        "settings refuses to start; stock models are served as usual (docs/serving.md)",
        reason,
    )
