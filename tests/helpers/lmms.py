"""What the lmms-eval plug-in tests share: the local task folder, the budget they prune to, and how to
launch lmms-eval from this interpreter."""

from __future__ import annotations

import sys
from pathlib import Path

TASK_DIR = Path(__file__).with_name("lmms_task")
"""The local tasks ``priortr_local_gen`` and ``priortr_local_mc`` (``--include_path``)."""

BUDGET, N_VISUAL = 4, 16
"""Visual tokens kept per image, of the tiny checkpoint's 16."""


def lmms_eval_command() -> list[str]:
    """The ``lmms-eval`` script beside this interpreter, else ``python -m lmms_eval``."""
    script = Path(sys.executable).with_name("lmms-eval")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lmms_eval"]
