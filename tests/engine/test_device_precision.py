"""Pruning on the test device in every dtype a user runs, against the masked reference there.

The rest of the suite compares in float64 on the CPU. Here every family runs on ``PRIORTR_TEST_DEVICE``
(``cpu`` by default; ``scripts/gpu-check.sh`` sets ``cuda``) in float32, bfloat16 and float16 (and
float64 off the CPU),
and the pruned model is compared with the reference (``tests/helpers/oracle.py``; for models with local or
linear-attention layers ``tests/helpers/pruned_reference.py``) on the same
device and in the same dtype: prefill logits of the kept real tokens agree to a tolerance of the
dtype's rounding, while the stock model misses by more than twice that (the comparison can fail), the
KV cache holds the text and the kept tokens only, and in float64/float32 the greedy tokens are equal.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import priortr
from tests.helpers.families import FAMILIES, setup
from tests.helpers.pruned import NEW_TOKENS, kept_rows, logits_atol, pruned_columns, reference_for

DEVICE = torch.device(os.environ.get("PRIORTR_TEST_DEVICE", "cpu"))
BUDGET, LAYER = 8, 1
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
"""Absolute logit tolerance; half precision: 4 units of rounding at the logits' scale."""


def _on_device(batch, dtype: torch.dtype) -> dict:
    return {
        key: value.to(DEVICE, dtype if value.is_floating_point() else value.dtype)
        if isinstance(value, torch.Tensor)
        else value
        for key, value in batch.kwargs().items()
    }


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
if DEVICE.type != "cpu":
    DTYPES.insert(0, torch.float64)  # on the CPU, tests/engine/test_equivalence.py covers float64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_matches_the_reference_on_the_device(family, dtype):
    model, batch = setup(family, 2)
    model = model.to(DEVICE, dtype)
    inputs = _on_device(batch, dtype)
    with priortr.apply(model, budget=BUDGET, layer=LAYER) as handle, torch.no_grad():
        logits = model(**inputs).logits
        result = handle.last
        out = model.generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    cache = out.cache if "cache" in out else out.past_key_values
    kept_tokens = batch.seq_len - batch.n_visual + BUDGET
    assert int(cache.get_seq_length()) == kept_tokens + NEW_TOKENS - 1
    on_host = dataclasses.replace(result, positions=result.positions.cpu(), padding=result.padding.cpu())
    pruned = pruned_columns(batch, result.kept.cpu())
    with reference_for(model, [(LAYER, pruned)], batch.attention_mask), torch.no_grad():
        reference = model(**inputs).logits
        expected = model.generate(
            **inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    with torch.no_grad():
        stock = model(**inputs).logits
    ref, real = kept_rows(reference.cpu().double(), on_host, batch)
    got = logits.cpu().double()  # the pruned forward's rows are the kept positions already
    unpruned, _ = kept_rows(stock.cpu().double(), on_host, batch)
    scale = ref[real].abs().max().item()
    tolerance = TOLERANCE.get(dtype, 4 * torch.finfo(dtype).eps * scale)
    if dtype == torch.float64:  # Llama 4's float32 RoPE and norms (tests.helpers.pruned.logits_atol)
        tolerance = logits_atol(model)
    error = (got[real] - ref[real]).abs().max().item()
    miss = (unpruned[real] - ref[real]).abs().max().item()
    assert error <= tolerance, f"{family} {dtype}: pruned vs reference {error:.3g} > {tolerance:.3g}"
    # negative control: the unpruned model's rows would fail the tolerance the pruned rows meet (a tiny
    # MoE in bfloat16 at transformers 5.17, GLM-4.6V's, lies 1.6x its tolerance from the reference)
    assert miss > tolerance, f"{family} {dtype}: the stock model is within {miss:.3g} of the reference"
    assert torch.isfinite(torch.stack(out.logits)).all()
    if dtype in TOLERANCE:  # half precision can flip a near-tie between two tokens
        assert torch.equal(out.sequences, expected)
