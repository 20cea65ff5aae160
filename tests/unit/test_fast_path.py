"""``benchmarks/fast_path.py`` (issue 47's rows in ``scripts/gpu-check.sh``) runs end to end on a CPU and
gives every row, on the tiny LLaVA: what ``--device cpu --tiny`` proves before a GPU run."""

from __future__ import annotations

import pytest
import torch

from benchmarks import fast_path
from priortr.tools.bench import bench_config
from scripts import tiny_model
from tests.helpers.tiny import llava_batch, tiny_llava


def test_every_row_on_a_cpu():
    model = tiny_llava(dtype=torch.float32)
    batch = llava_batch(model, batch_size=1).kwargs()
    rows = fast_path.measure(
        model, {1: batch}, budget=4, layer=1, repeats=2, new_tokens=2, record=lambda row: None
    )
    kinds = [(row["what"], row["K"]) for row in rows]
    for what in (
        "eager prefill, batch 1",
        "syncs",
        "compiled static decode step, batch 1",
        "compiled prefill, batch 1",
    ):
        assert kinds.count((what, None)) == kinds.count((what, 4)) == 1, kinds
    vanilla, pruned = (row for row in rows if row["what"] == "syncs")
    assert vanilla["cuda_prefill"] is None  # CUDA's own count needs CUDA
    assert pruned["predicted_prefill"] == vanilla["predicted_prefill"] + 1  # the prompt's one copy
    assert pruned["predicted_prefill_h2d"] == vanilla["predicted_prefill_h2d"] + 1  # the plan's one copy
    assert pruned["predicted_decode_step"] == vanilla["predicted_decode_step"]
    for row in rows:
        if row["what"] == "compiled prefill, batch 1":
            assert row["graphs"] >= 1 and row["wall_ms"] > 0
    assert "| K |" in fast_path.markdown(rows) or "| K " in fast_path.markdown(rows)
    assert model._compiled_call_impl is None  # the model is eager again


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """The model ``gpu-check.sh --tiny`` runs (``scripts/tiny_model.py``), as a config directory."""
    directory = tmp_path_factory.mktemp("tiny-llava")
    tiny_model.tiny_config().save_pretrained(directory)
    return str(directory)


def test_the_tiny_model_differs_from_the_full_one_in_sizes_only(tiny):
    full, small = bench_config("llava-1.5-7b"), bench_config(tiny)
    assert type(small) is type(full) and small.image_seq_length == full.image_seq_length == 576
    assert small.text_config.num_hidden_layers == 4 and small.vision_config.num_hidden_layers == 1
    assert small.text_config.hidden_size * 4 == full.text_config.hidden_size
    assert small.text_config.head_dim == full.text_config.head_dim == 128
    assert small.vision_config.to_dict() | {"num_hidden_layers": 24} == full.vision_config.to_dict()


@pytest.mark.parametrize("which", ["tiny", "full"])
def test_the_scored_layer_fits_the_tiny_model_as_it_fits_the_full_one(tiny, which):
    """``gpu-check.sh --tiny`` scores the GPU run's layer (2 by default) on a model deep enough for it;
    checked on a weightless skeleton, as main does before building anything."""
    fast_path.check(tiny if which == "tiny" else "llava-1.5-7b", budget=64, layer=2)


def test_a_layer_the_model_lacks_is_refused_before_the_build(tmp_path):
    """The control, and what the 2-layer tiny run of before did: layer 2 needs a layer after it."""
    bench_config("llava-1.5-7b", layers=2, vision_layers=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 0\] for this 2-layer model"):
        fast_path.check(str(tmp_path), budget=64, layer=2)
