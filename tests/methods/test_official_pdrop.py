"""PyramidDrop at its defaults keeps the tokens the authors' code keeps.

Reference: Cooperx521/PyramidDrop at 6444f304aee4b7edcb022839fb9e8cd07859704a,
``llava/model/modeling_llama_pdrop.py`` (``LlamaModel.forward`` and ``pdrop_rank_drop``), restated here:

* after decoder layer ``layer_idx``, if ``rank_layer = layer_idx + 1`` is in ``layer_list`` (8/16/24 of
  32 layers: a quarter, half and three quarters of the depth), rank with layer ``rank_layer``: its
  ``input_layernorm``, ``q_proj`` and ``k_proj`` and RoPE applied to the output of ``layer_idx``;
* the query is the last prompt token (``prompt_total_len - 1``: the prompt's text tokens plus its image
  tokens, minus one); softmax over every key (causal mask) in float32, mean over heads, restricted to
  the image tokens left, ``topk(int(N * ratio))`` with ratios 1/2, 1/4, 1/8 of the original N.

The harness keeps original RoPE positions after a drop (the authors renumber): the reference here does
too. The library is driven through ``priortr.apply`` only.
"""

from __future__ import annotations

import math

import pytest
import torch

import priortr
from tests.helpers.layerwise import projections, run_layers
from tests.helpers.tiny import llava_batch


def official_pdrop(model, batch, ratios: list[float], rank_next: bool = True) -> list[torch.Tensor]:
    """The visual positions kept after each stage, as the authors' code ranks them (``rank_next``) or
    with the scored layer's own attention (the library's former behaviour, a negative control)."""
    language_model = model.model.language_model
    layers = language_model.layers
    n_layers = len(layers)
    layer_list = [n_layers * i // 4 for i in (1, 2, 3)]
    visual = batch.visual_mask()[0].nonzero().flatten()
    n_visual = visual.numel()
    stages = []

    def drop(index, hidden, layer_input, kept):
        rank_layer = index + 1
        if rank_layer not in layer_list:
            return None
        stage = layer_list.index(rank_layer)
        if rank_next:
            queries, keys = projections(layers[rank_layer], hidden, kept, language_model.rotary_emb)
        else:
            queries, keys = projections(layers[index], layer_input, kept, language_model.rotary_emb)
        logits = queries[:, -1:] @ keys.transpose(-1, -2) / math.sqrt(queries.shape[-1])  # [H, 1, S']
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32)
        per_token = weights.mean(dim=0)[0]  # [S']
        is_visual = torch.isin(kept, visual)
        keep_length = int(n_visual * ratios[stage + 1])
        top = per_token[is_visual].topk(keep_length).indices
        survivors = torch.cat([kept[~is_visual], kept[is_visual][top]]).sort().values
        stages.append(survivors[torch.isin(survivors, visual)])
        return survivors

    run_layers(model, batch, drop)
    return stages


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pdrop_default_keeps_the_official_tokens(eager_llava, seed):
    batch = llava_batch(eager_llava, 1, seed=seed)
    expected = official_pdrop(eager_llava, batch, [1.0, 0.5, 0.25, 0.125])
    with priortr.apply(eager_llava, method="pdrop", budget=2) as handle, torch.no_grad():
        eager_llava(**batch.kwargs())
    result = handle.last
    assert [stage.layer for stage in result.stages] == [0, 1, 2]
    for stage, kept in zip(result.stages, expected, strict=True):
        assert stage.kept[0].tolist() == kept.tolist()
    assert result.kept[0].tolist() == expected[-1].tolist()


def test_ranking_with_the_scored_layer_itself_differs(eager_llava):
    """Negative control: ranking with the scored layer's own attention keeps other tokens."""
    differs = 0
    for seed in range(3):
        batch = llava_batch(eager_llava, 1, seed=seed)
        official = official_pdrop(eager_llava, batch, [1.0, 0.5, 0.25, 0.125])
        former = official_pdrop(eager_llava, batch, [1.0, 0.5, 0.25, 0.125], rank_next=False)
        differs += any(a.tolist() != b.tolist() for a, b in zip(official, former, strict=True))
    assert differs >= 2
