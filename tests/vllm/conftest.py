"""The vLLM tests run only where vLLM is installed (``scripts/test-vllm.sh`` builds ``.venv-vllm``);
elsewhere this folder is skipped. Engines run in this process (no engine-core or worker processes),
so a test can patch a fault into the plug-in and see the answer change. A run serves with the model
runner ``scripts/test-vllm.sh --runner`` chose (``runners.py``), and every engine a test builds is
checked to run it."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "last_in_class: runs after the other tests of its class (family_contract.py)"
    )


def pytest_report_header() -> str:
    from tests.vllm.runners import RUNNER

    return f"vLLM model runner: {RUNNER} (PRIORTR_VLLM_RUNNER)"


@pytest.fixture(scope="session", autouse=True)
def engines_run_the_chosen_runner() -> Iterator[None]:
    """Every offline engine a test builds is checked, once built, to run the runner this test run asked
    for (``runners.check_engine``); a server is checked through its log (``test_http.serving``)."""
    from vllm import LLM

    from tests.vllm.runners import check_engine

    stock = LLM.__init__

    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        stock(self, *args, **kwargs)
        check_engine(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LLM, "__init__", checked)
        yield


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked ``last_in_class`` starts and deletes an engine of its own, which tears down vLLM's
    process groups that its class's shared engine needs: it moves behind the rest of its class (a
    subclass's own tests are collected after the ones it inherits)."""
    for item in [item for item in items if item.get_closest_marker("last_in_class")]:
        items.remove(item)
        end = max(index for index, other in enumerate(items) if other.parent is item.parent)
        items.insert(end + 1, item)


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm import checkpoints

    return checkpoints.llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm import checkpoints

    return checkpoints.qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"))


@pytest.fixture(scope="session")
def qwen2_5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm import checkpoints

    return checkpoints.qwen2_5_vl(tmp_path_factory.mktemp("qwen2.5-vl"))


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm import checkpoints

    return checkpoints.qwen3_vl(tmp_path_factory.mktemp("qwen3-vl"))


@pytest.fixture(scope="session")
def qwen3_vl_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm import checkpoints

    return checkpoints.qwen3_vl_moe(tmp_path_factory.mktemp("qwen3-vl-moe"))


@pytest.fixture(scope="session")
def internvl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm import checkpoints

    return checkpoints.internvl(tmp_path_factory.mktemp("internvl"))


@pytest.fixture(scope="session")
def internvl3_5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm import checkpoints

    return checkpoints.internvl(tmp_path_factory.mktemp("internvl3.5"), text_model="qwen3")


@pytest.fixture(scope="session")
def onevision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm import checkpoints

    return checkpoints.llava_onevision(tmp_path_factory.mktemp("llava-onevision"))


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm import checkpoints

    return checkpoints.gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="session")
def mistral3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm import checkpoints

    return checkpoints.mistral3(tmp_path_factory.mktemp("mistral3"))


@pytest.fixture(scope="session")
def llava_next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm import checkpoints

    return checkpoints.llava_next(tmp_path_factory.mktemp("llava-next"))


@pytest.fixture(scope="session")
def glm4v_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm import checkpoints

    return checkpoints.glm4v(tmp_path_factory.mktemp("glm4v"))
