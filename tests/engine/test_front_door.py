"""The engine's front door for a front end that runs the layers itself (the vLLM plug-in): what it plans
for a multi-stage method, on a tiny LLaVA's config (4 decoder layers, 16 tokens an image). The
answers through it are checked against ``priortr.apply`` in ``tests/vllm/test_multi_stage.py``."""

from __future__ import annotations

import pytest
import torch

from priortr.adapters import adapter_for
from priortr.engine.config import PruningConfig
from priortr.engine.front_door import StagedPrompt, kept_runs, last_stage
from tests.helpers.tiny import LLAVA_IMAGE_ID, LLAVA_N_VISUAL, tiny_llava

N_LAYERS = 4
TEXT = [1, 5, 6]  # before the image
QUESTION = [7, 8, 9, 10]  # after it: the separator and the instruction


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llava(dtype=torch.float32)


def prompt(images: int = 1) -> list[int]:
    """Text, ``images`` images of 16 tokens each with text between them, then the question."""
    out = list(TEXT)
    for index in range(images):
        out += [LLAVA_IMAGE_ID] * LLAVA_N_VISUAL + ([11] if index < images - 1 else [])
    return out + QUESTION


@pytest.mark.parametrize(
    ("settings", "layers", "kept"),
    [
        ({"method": "pdrop", "budget": 4}, (0, 1, 2), 4),  # 16 keep 10, 6, then 4
        ({"method": "clse", "budget": 8}, (0, 1, 2), 2),  # 16 keep 13, 8, then 2
        ({"method": "priortr", "stages": [(1, 8), (2, 4)]}, (1, 2), 4),
        ({"method": "priortr", "budget": 4, "layer": 1}, (1,), 4),
    ],
)
def test_kept_runs_count_the_last_stage(model, settings, layers, kept):
    """A run's slots are what it keeps after its last stage; the layers run outside the cache reach the
    deepest stage; the staged prompt plans the stages ``apply`` runs."""
    config = PruningConfig.of(n_layers=N_LAYERS, **settings)
    adapter = adapter_for(model)
    runs = kept_runs(adapter, model.config, config, prompt())
    assert [run.kept_count for run in runs] == [kept]
    assert last_stage(config, N_LAYERS) == layers[-1]
    staged = StagedPrompt(adapter, model.config, config, prompt(), [kept])
    assert staged.layers == layers


def test_counts_the_plan_disagrees_with_are_refused(model):
    """A multi-stage method plans its stages from the engine's budget: slots laid out for another
    budget are refused, not served with the wrong schedule."""
    config = PruningConfig.of(n_layers=N_LAYERS, method="pdrop", budget=4)
    with pytest.raises(RuntimeError, match=r"laid out for \[3, 3\] kept tokens .* keep \[2, 2\]"):
        StagedPrompt(adapter_for(model), model.config, config, prompt(2), [3, 3])
