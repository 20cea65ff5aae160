"""Fixtures of the command and plug-in tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checkpoint import save_tiny_llava_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A loadable tiny LLaVA checkpoint directory (model + processor), written once per module."""
    return save_tiny_llava_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny-llava")
