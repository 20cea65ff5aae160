"""The probe's prior and posterior equal those read off eager attention's full weight matrix."""

from __future__ import annotations

import pytest
import torch

import priortr
from tests.helpers.tiny import Batch, llava_batch, qwen_batch, tiny_llava, tiny_qwen2_5_vl

LAYER = 1
FAMILIES = [(tiny_llava, llava_batch), (tiny_qwen2_5_vl, qwen_batch)]


def expected_evidence(attn: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, P and the last row, by the paper's definition, from a full [B, H, S, S] attention matrix."""
    priors, posteriors, lasts = [], [], []
    for b in range(batch.batch_size):
        cols = slice(batch.image_start[b], batch.image_end[b])
        sep = batch.image_end[b]
        rows = [r for r in range(sep, batch.seq_len) if batch.attention_mask[b, r]]  # j >= i_e
        prior = attn[b, :, sep, cols].mean(0)
        posterior = torch.stack([attn[b, :, r, cols].mean(0) for r in rows]).mean(0)
        last = attn[b, :, batch.seq_len - 1, cols].mean(0)
        priors.append(prior / prior.sum())
        posteriors.append(posterior / posterior.sum())
        lasts.append(last / last.sum())
    return torch.stack(priors), torch.stack(posteriors), torch.stack(lasts)


@pytest.mark.parametrize("build, make_batch", FAMILIES)
@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_probe_matches_eager_attention(build, make_batch, attn_impl, batch_size):
    # float32: transformers' eager attention turns fully padded float64 rows into NaN.
    eager = build(attn="eager", dtype=torch.float32)
    batch = make_batch(eager, batch_size=batch_size)
    with torch.no_grad():
        attn = eager(**batch.kwargs(), output_attentions=True).attentions[LAYER]
    prior, posterior, last = expected_evidence(attn, batch)

    model = build(attn=attn_impl, dtype=torch.float32)
    kwargs = batch.kwargs()
    if batch_size == 1:
        del kwargs["attention_mask"]  # SDPA then runs with mask=None: the probe must still be causal
    with priortr.apply(model, method="fastv", budget=batch.n_visual, layer=LAYER) as handle, torch.no_grad():
        model(**kwargs)
    result = handle.last
    torch.testing.assert_close(result.prior, prior, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(result.posterior, posterior, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(result.scores, last, atol=1e-6, rtol=1e-5)  # fastv = last row


def test_prior_is_blind_to_the_instruction():
    """Negative control for the authors' Qwen defect: changing the instruction must not move Q."""
    model = tiny_qwen2_5_vl()
    batch = qwen_batch(model)
    other = qwen_batch(model)
    sep = batch.image_end[0]
    other.input_ids = batch.input_ids.clone()
    other.input_ids[0, sep + 1 :] = torch.flip(batch.input_ids[0, sep + 1 :], dims=[0]) % 150 + 3
    assert not torch.equal(other.input_ids, batch.input_ids)
    results = []
    with priortr.apply(model, budget=4, layer=LAYER) as handle, torch.no_grad():
        for b in (batch, other):
            model(**b.kwargs())
            results.append(handle.last)
    torch.testing.assert_close(results[0].prior, results[1].prior, atol=0, rtol=0)
    assert not torch.allclose(results[0].posterior, results[1].posterior)
