"""DART at its defaults keeps the tokens the authors' code keeps.

Reference: ZichenWen1/DART, ``llava/model/language_model/modeling_llama_self.py`` at the authors' commit
9fee9fa199d591cf91891ad468ab52c754de9bf5 (read from the fork xqy1111111/DART, which carries their
history), ``LlamaModel.forward`` and ``get_retained_image_token``; settings of
``scripts/v1_5/eval/*.sh`` (``--pruned_layer 2 --pivot_image_token 4 --pivot_text_token 4
--max_num_trunction 128``). Restated here:

* before decoder layer K = ``pruned_layer`` (2) runs, read layer K - 1's output, through the model's
  final norm (``self.norm``, RMSNorm with its gain), and layer K - 1's keys after RoPE (``any_states``:
  every head side by side, [S, H * d]);
* pivots: the ``pivot_image_token`` image tokens and the ``pivot_text_token`` tokens after the image
  with the largest key L1 norm;
* ``TOKEN_TOPK = ceil(M // (pivots))`` with M = ``max_num_trunction``; visiting the pivots in the order
  of a Python ``set`` of their positions, each takes the ``TOKEN_TOPK`` image tokens not yet taken (image
  pivots excluded) with the lowest cosine similarity to it (normed hidden states);
* kept: the image pivots and every taken token: ``pivot_image_token + pivots * TOKEN_TOPK`` tokens
  (132 for M = 128), so the library's budget K = that count.

The library is driven through ``priortr.apply`` only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import priortr
from tests.helpers.layerwise import projections
from tests.helpers.tiny import llava_batch

PRUNED_LAYER = 2


def official_dart(
    model,
    batch,
    max_num_trunction: int,
    pivot_image_token: int = 4,
    pivot_text_token: int = 4,
    visit: Callable[[set[int]], list[int]] = list,
) -> list[int]:
    """The visual positions DART keeps on batch row 0 (one image, no padding); ``visit`` orders the
    pivots (the authors iterate the set itself)."""
    language_model = model.model.language_model
    with torch.no_grad():
        hidden_states = model(**batch.kwargs(), output_hidden_states=True).hidden_states
        last_layer_state = language_model.norm(hidden_states[PRUNED_LAYER])[0]  # [S, D]
        positions = torch.arange(batch.seq_len)
        layer = language_model.layers[PRUNED_LAYER - 1]
        _, keys = projections(layer, hidden_states[PRUNED_LAYER - 1], positions, language_model.rotary_emb)
    any_states = keys.transpose(0, 1).reshape(batch.seq_len, -1)  # [S, H * d]
    start, length = batch.image_start[0], batch.n_visual
    token_topk = math.ceil(max_num_trunction // (pivot_image_token + pivot_text_token))

    image_norm = torch.norm(any_states[start : start + length], p=1, dim=-1)
    query_norm = torch.norm(any_states[start + length :], p=1, dim=-1)
    image_indices = (image_norm.topk(pivot_image_token).indices + start).tolist()
    query_indices = (query_norm.topk(pivot_text_token).indices + start + length).tolist()
    indices_set = set(image_indices + query_indices)
    valid_indices = set(range(start, start + length)) - set(image_indices)
    valid_indices_list = list(valid_indices)
    for item in visit(indices_set):
        valid_vectors = last_layer_state[valid_indices_list, :]
        cos_sim = -F.cosine_similarity(last_layer_state[item, :], valid_vectors, dim=-1)
        top_k_indices = cos_sim.topk(token_topk).indices
        top_k_real_indices = [valid_indices_list[i] for i in top_k_indices]
        indices_set.update(top_k_real_indices)
        valid_indices.difference_update(top_k_real_indices)
        valid_indices_list = list(valid_indices)
    indices_set.difference_update(query_indices)
    return sorted(indices_set)


# 45 text tokens before the image put the pivots at positions 46-67, where a Python set (32 slots for
# 8 integers) no longer iterates them in ascending order.
@pytest.mark.parametrize("text_before", [3, 45])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dart_default_keeps_the_official_tokens(eager_llava, seed, text_before):
    batch = llava_batch(eager_llava, 1, seed=seed, text_before=(text_before,))
    expected = official_dart(eager_llava, batch, max_num_trunction=8)  # 4 + 8 * 1 = 12 of 16
    with priortr.apply(eager_llava, method="dart", budget=len(expected)) as handle, torch.no_grad():
        eager_llava(**batch.kwargs())
    assert [stage.layer for stage in handle.last.stages] == [PRUNED_LAYER - 1]
    assert handle.last.kept[0].tolist() == expected


def test_the_visiting_order_matters(eager_llava):
    """Negative control: visiting the pivots in ascending position order keeps another set on a prompt
    whose pivots wrap around the set's 32 slots (where its order is not ascending)."""
    differs = 0
    for seed in range(3):
        batch = llava_batch(eager_llava, 1, seed=seed, text_before=(45,))
        official = official_dart(eager_llava, batch, max_num_trunction=8)
        differs += official != official_dart(eager_llava, batch, max_num_trunction=8, visit=sorted)
    assert differs >= 1
