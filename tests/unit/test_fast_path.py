"""``benchmarks/fast_path.py`` (issue 47's rows in ``scripts/gpu-check.sh``) runs end to end on a CPU and
gives every row, on the tiny LLaVA: what ``--device cpu --tiny`` proves before a GPU run."""

from __future__ import annotations

import torch

from benchmarks import fast_path
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
