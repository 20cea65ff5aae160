"""FastV at its defaults keeps the tokens the authors' code keeps.

Reference: pkunlp-icler/FastV at d1659729b5bf1be225e99ee15783deeea80f63b1,
``src/FastV/llava-hf/transformers/src/transformers/models/llama/modeling_llama.py`` (``LlamaModel.forward``
with ``fastv_config``), restated here: the attention weights of decoder layer ``FASTV_k - 1`` (the layer
run just before layer ``FASTV_k``, where tokens are dropped), averaged over heads, the last prompt token's
row, restricted to the image tokens; ``topk(round(N * (1 - FASTV_r)))`` of them are kept. The paper's
setting is K = 2 (``FASTV_k = 2``), so the scored layer is 1.

The library is driven through ``priortr.apply`` only; the reference reads the stock model's own attention
weights (eager attention, ``output_attentions=True``).
"""

from __future__ import annotations

import pytest
import torch

import priortr
from tests.helpers.tiny import llava_batch

FASTV_K = 2


def official_fastv(model, batch, keep: int, fastv_k: int = FASTV_K) -> list[int]:
    """The visual positions FastV keeps: top ``keep`` of layer ``fastv_k - 1``'s head-mean last row."""
    with torch.no_grad():
        attentions = model(**batch.kwargs(), output_attentions=True).attentions
    last_layer_attention_avg = attentions[fastv_k - 1].mean(dim=1)[0]  # [S, S]
    last_tok = last_layer_attention_avg[-1]  # [S]
    visual = batch.visual_mask()[0].nonzero().flatten()
    top = last_tok[visual].topk(keep).indices
    return sorted(visual[top].tolist())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [4, 8])
def test_fastv_default_keeps_the_official_tokens(eager_llava, seed, budget):
    batch = llava_batch(eager_llava, 1, seed=seed)
    with priortr.apply(eager_llava, method="fastv", budget=budget) as handle, torch.no_grad():
        eager_llava(**batch.kwargs())
    assert [stage.layer for stage in handle.last.stages] == [FASTV_K - 1]
    assert handle.last.kept[0].tolist() == official_fastv(eager_llava, batch, budget)


def test_a_ratio_budget_keeps_round_n_times_one_minus_r(eager_llava):
    """FastV's R is the dropped share: budget = 1 - R keeps round(N * (1 - R)) tokens."""
    batch = llava_batch(eager_llava, 1, seed=0)
    with priortr.apply(eager_llava, method="fastv", budget=0.25) as handle, torch.no_grad():
        eager_llava(**batch.kwargs())
    assert handle.last.kept[0].tolist() == official_fastv(eager_llava, batch, round(batch.n_visual * 0.25))


def test_scoring_the_next_layer_keeps_other_tokens(eager_llava):
    """Negative control: FastV's K = 3 (the library's former default layer 2) ranks differently."""
    differs = 0
    for seed in range(3):
        batch = llava_batch(eager_llava, 1, seed=seed)
        differs += official_fastv(eager_llava, batch, 4) != official_fastv(
            eager_llava, batch, 4, fastv_k=FASTV_K + 1
        )
    assert differs >= 2
