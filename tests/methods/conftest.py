"""Fixtures of the method tests."""

from __future__ import annotations

import pytest

from tests.helpers.tiny import tiny_llava


@pytest.fixture(scope="module")
def eager_llava():
    """The tiny float64 LLaVA with eager attention, whose weights the authors' restated code reads."""
    return tiny_llava(attn="eager")
