"""Models split across devices with ``device_map`` (accelerate): layers offloaded to CPU and disk have
their weights moved in only while they run, and a pruned forward, ``generate()`` and what was kept
must equal those of the same model held in memory (logits to 1e-12: see the test). The scored layer
itself is offloaded to disk, so the engine's q/k capture sees weights that are on the meta device
between calls."""

from __future__ import annotations

import pytest
import torch

import priortr
from tests.helpers.families import FAMILIES
from tests.helpers.pruned import generate

OFFLOADED = {
    "model.language_model.layers.1": "disk",
    "model.language_model.layers.2": "disk",
    "lm_head": "disk",
}


def _offloaded_copy(model, tmp_path):
    """``model`` saved and loaded back with a device map that puts layers 1, 2 and the LM head on disk."""
    model.save_pretrained(tmp_path / "model")
    device_map = {"model." + name: "cpu" for name, _ in model.model.named_children()} | {"lm_head": "cpu"}
    device_map.pop("model.language_model")
    inner = model.model.language_model
    device_map |= {
        f"model.language_model.{name}": "cpu" for name, _ in inner.named_children() if name != "layers"
    }
    device_map |= {f"model.language_model.layers.{i}": "cpu" for i in range(len(inner.layers))}
    device_map |= OFFLOADED
    return (
        type(model)
        .from_pretrained(
            tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload", dtype=model.dtype
        )
        .eval()
    )


@pytest.mark.parametrize("family", ["llava", "qwen2.5-vl"])
@pytest.mark.parametrize(("method", "layer"), [("priortr", 1), ("pdrop", None)])
def test_offloaded_model_prunes_exactly_like_the_model_in_memory(family, method, layer, tmp_path):
    build, make_batch = FAMILIES[family]
    model = build()
    batch = make_batch(model, 2)
    offloaded = _offloaded_copy(model, tmp_path)
    assert offloaded.model.language_model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    results = []
    for candidate in (model, offloaded):
        with priortr.apply(candidate, method=method, budget=5, layer=layer) as handle, torch.no_grad():
            logits = candidate(**batch.kwargs()).logits
            out = generate(candidate, batch)
        results.append((logits, out, handle.last))
    (logits, out, last), (off_logits, off_out, off_last) = results
    assert last.pruned and torch.equal(last.kept, off_last.kept)
    assert torch.equal(out.sequences, off_out.sequences)
    # Kept and generated tokens are exact; logits equal to 1e-12, not bit-exact. The loaded copy's weights
    # sit at other addresses (safetensors and offload files: 24 mod 64 bytes, where torch allocates on 64),
    # and MKL's float64 GEMM rounds by the weight's alignment whenever the row count B x S is not 2, 3 or
    # a multiple of 4 (measured on AMD EPYC, MKL's AVX2 path; MKL_CBWR=COMPATIBLE makes it bit-exact).
    # Pruned, the language model runs 2 x 19 = 38 rows (both families), so logits move by an ulp
    # (1.1e-16); unpruned, its 2 x 30 (LLaVA) or 2 x 26 (Qwen2.5-VL) rows are alignment-free (LLaVA's
    # vision tower, 2 x 17 rows, differs by ulps that round away), so unpruned logits happen to be
    # bit-identical. 1e-12 is ~1e4 below any difference pruning makes (the equivalence suite's controls:
    # > 1e-6).
    torch.testing.assert_close(logits, off_logits, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(off_out.logits), atol=1e-12, rtol=0)
