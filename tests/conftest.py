"""Fixtures shared by the whole suite (folders add their own in their ``conftest.py``).

The suite, by what it checks:

- ``unit/``: pure functions on hand-computed values (scoring, FLOPs, report tables, bench statistics);
- ``engine/``: pruning equals the masked reference (``helpers/oracle.py``), and the engine's evidence,
  probe, several images, offloading, overhead counts, misuse and errors;
- ``families/``: the adapter contract over every family, then what only one family does;
- ``methods/``: every method through the engine, selectors on hand-made inputs, and each method
  against its authors' code (``test_official_*``);
- ``cli/``: the commands, the README and the lmms-eval plug-in, on a saved tiny checkpoint;
- ``testbed/``: the trained testbed's data, training, model and evaluation;
- ``helpers/``: tiny random-weight models and batches, the masked reference, checkpoints (no tests).

The tiny models and batches themselves are built by ``tests.helpers``; fixtures here only decide how
long one lives.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import PreTrainedModel

from tests.helpers.families import FAMILIES


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``scripts/test.sh`` runs one worker per core) each worker takes its share of
    the cores: torch's default, every core in every worker, oversubscribes them and runs the suite
    several times slower than one process."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


class TinyModels(dict):
    """Each family's tiny float64 model (``tests.helpers.families.FAMILIES``), built on first use."""

    def __missing__(self, family: str) -> PreTrainedModel:
        model = self[family] = FAMILIES[family][0]()
        return model


@pytest.fixture(scope="module")
def models() -> TinyModels:
    """{family: tiny model}, shared by the tests of one module (they must leave the models as found)."""
    return TinyModels()


LONG_MODULES = (
    "tests/testbed/test_accuracy.py",
    "tests/testbed/test_model.py",
    "tests/cli/test_lmms_eval_dp.py",
    "tests/cli/test_lmms_eval.py",
    "tests/vllm/test_multi_stage.py",
    "tests/vllm/test_parallel.py",
    "tests/vllm/test_moe_parallel.py",
    "tests/vllm/test_pipeline_dense.py",
    "tests/vllm/test_http.py",
)
"""Modules of few tests that run for minutes (the trained testbed's accuracy check; lmms-eval in one and in
two processes; in the vLLM suite, the multi-stage methods' 24 engines, a class each so that the workers
share them, and the scale-out and HTTP servers). ``scripts/test.sh`` and ``scripts/test-vllm.sh`` send them to
the workers first (``--no-loadscope-reorder``): xdist's default order, the modules with the most tests
first, started them last, so that one worker ran them alone at the end. The slowest tests of each run are
printed (``--durations``) to keep this list true."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``LONG_MODULES`` first, the rest in collection order (the sort is stable)."""
    rank = {module: i for i, module in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
