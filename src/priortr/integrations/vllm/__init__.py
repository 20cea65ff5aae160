"""priortr inside vLLM: visual tokens pruned after decoder layer L of a served model (docs/serving.md).

``register`` is vLLM's ``vllm.general_plugins`` entry point, run in every vLLM process (its CLI
parsing included): on a vLLM release in ``SUPPORTED_VLLM`` it registers the pruning model classes
under vLLM's LLaVA-1.5, Qwen2-VL, Qwen2.5-VL and Qwen3-VL architecture names, with their processors
and config hooks, and a config hook that refuses ``priortr`` settings on the other families
``priortr.apply`` prunes. A model whose config carries no ``priortr`` settings is built as vLLM's own
class. On any other vLLM, or on any error while registering, it logs one warning and registers
nothing, so stock vLLM keeps working.
"""

from __future__ import annotations

import logging

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM = SpecifierSet(">=0.32,<0.34")
"""The vLLM releases whose internals the plug-in was written and checked against (docs/serving.md)."""

logger = logging.getLogger(__name__)


def supported(version: str) -> bool:
    """Whether a vLLM version string (a local or development build included) is in ``SUPPORTED_VLLM``."""
    try:
        return SUPPORTED_VLLM.contains(Version(version).base_version)
    except InvalidVersion:
        return False


def register() -> None:
    """Register the pruning model classes, processors and config hooks with vLLM, or nothing."""
    try:
        import vllm

        found = vllm.__version__
        if not supported(found):
            logger.warning(
                "priortr's vLLM plug-in supports vLLM %s and found %s: it registers nothing (the models "
                "serve unpruned); install a supported vLLM (docs/serving.md)",
                SUPPORTED_VLLM,
                found,
            )
            return
        from priortr.integrations.vllm.registration import register_all

        register_all()
    except Exception as error:
        logger.warning(
            "priortr's vLLM plug-in registers nothing (the models serve unpruned): %s: %s",
            type(error).__name__,
            error,
        )
