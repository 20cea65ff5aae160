"""Fixtures shared by the whole suite (folders add their own in their ``conftest.py``).

The tiny models and batches themselves are built by ``tests.helpers``; fixtures here only decide how
long one lives.
"""

from __future__ import annotations

import pytest
from transformers import PreTrainedModel

from tests.helpers.families import FAMILIES


class TinyModels(dict):
    """Each family's tiny float64 model (``tests.helpers.families.FAMILIES``), built on first use."""

    def __missing__(self, family: str) -> PreTrainedModel:
        model = self[family] = FAMILIES[family][0]()
        return model


@pytest.fixture(scope="module")
def models() -> TinyModels:
    """{family: tiny model}, shared by the tests of one module (they must leave the models as found)."""
    return TinyModels()
