"""CLSE keeps the tokens its authors' code keeps, at every stage, on LLaVA-1.5 and Qwen2-VL.

Reference: CodeChildCZJ/PriorTR at e442a4c14af1b333067a6b8310c9111cad922033, restated here:

* ``image/LLaVA/llava/vtr/strategy/clse.py``: ``_spatial_spectral_score_2d`` (2-D FFT of each channel
  on the h x w grid, ``fftshift``, Gaussian high-pass ``1 - exp(-d^2 / (2 (min(h//2, w//2) 0.1)^2))``,
  inverse FFT magnitude averaged over channels, in float32), ``_get_evolution_factor`` (|s_Lk - s_L| /
  (mean s_L + s_L + 1e-6) capped at 1, standardised with the unbiased std + 1e-6, sigmoid of it / 0.1),
  ``compute_scores`` (last row, head mean; times the evolution factor at stage 0 only), ``_TOKEN_DICT``
  (64: 110 / 70 / 20 ...), ``select_tokens`` (``topk(k).indices.sort()``), ``default_prune_layers``.
* ``image/LLaVA/llava/vtr/model/prunable_llama.py``: ``z_ref`` is the image's hidden states entering
  decoder layer 0 (``ref_layers=[0]``); after layer k - 1 (prune layer k) the strategy gets that layer's
  attention and its output (``vtr_ctx["hidden_states"]``) and the tokens are dropped.
* ``image/Qwen2-VL/visual_token_pruning/strategy/clse.py`` and ``model/prunable_qwen2_vl.py``: the same
  score, the grid ``image_grid_thw[0][1:] // 2``, and ``_RATIO_DICT`` (0.112: int(N x 0.19 / 0.12 /
  0.034), at least 1).

The port runs the stock model's language model layer by layer (``tests/helpers/layerwise.py``, the
kept tokens at their own positions, Qwen's M-RoPE ids included) and drops tokens where the authors'
runners do. The library runs through ``priortr.apply(model, method="clse", budget=...)`` only; every
stage's ``handle.last.stages[i].kept`` is compared.
"""

from __future__ import annotations

import math

import pytest
import torch

import priortr
from tests.helpers.layerwise import input_embeddings, projections, run_layers
from tests.helpers.tiny import language_model_inputs, llava_batch, qwen_batch, tiny_llava, tiny_qwen2_vl

LLAVA_DEPTH = 6  # the authors' prune layers [1, round(2.16), round(4.02)] = [1, 2, 4]: scored 0 / 1 / 3
LLAVA_SCORED = [0, 1, 3]
LLAVA_GRID = (24, 24)  # 168 px at 7 px patches: LLaVA-1.5's 576 tokens
QWEN_GRID = (1, 24, 36)  # patches; merged 2 x 2: a 12 x 18 grid, 216 tokens


def authors_high_frequency(x: torch.Tensor, h: int, w: int, cutoff_ratio: float = 0.1) -> torch.Tensor:
    """``_spatial_spectral_score_2d``: x [B, N, C] -> [B, N]."""
    batch, n, channels = x.shape
    feat = x.transpose(1, 2).reshape(batch, channels, h, w)
    shifted = torch.fft.fftshift(torch.fft.fft2(feat.float()), dim=(-2, -1))
    center_h, center_w = h // 2, w // 2
    y, x_idx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    dist = torch.sqrt((y - center_h) ** 2 + (x_idx - center_w) ** 2)
    mask = 1 - torch.exp(-(dist**2) / (2 * (min(center_h, center_w) * cutoff_ratio) ** 2))
    filtered = torch.fft.ifftshift(shifted * mask[None, None], dim=(-2, -1))
    return torch.fft.ifft2(filtered).abs().mean(dim=1).reshape(batch, n)


def authors_evolution(s_l: torch.Tensor, s_lk: torch.Tensor, temp: float = 0.1) -> torch.Tensor:
    """``_get_evolution_factor``."""
    epsilon = 1e-6
    evo = torch.clamp(torch.abs(s_lk - s_l) / (s_l.mean(dim=-1, keepdim=True) + s_l + epsilon), max=1)
    norm = (evo - evo.mean(dim=-1, keepdim=True)) / (evo.std(dim=-1, keepdim=True) + epsilon)
    return torch.sigmoid(norm / temp)


def authors_score(attn_row, z_ref, z_now, grid, spectral: bool = True) -> torch.Tensor:
    """``compute_scores``: attn_row [N] (head mean, last row); z_ref, z_now [1, N, C]; grid (h, w) or
    None (attention only)."""
    if grid is None or not spectral:
        return attn_row
    h, w = grid
    evo = authors_evolution(authors_high_frequency(z_ref, h, w), authors_high_frequency(z_now, h, w))
    return (evo * attn_row)[0]


def official_stages(
    model, batch, keeps: list[int], prune_after: list[int], grid, spectral: bool = True, rope=None
) -> list[list[int]]:
    """The visual positions kept after each of the authors' three stages, scored after the layers
    ``prune_after`` (their prune layers minus one), as their runners drop them (``rope``: Qwen's
    M-RoPE ids, as ``run_layers`` takes them)."""
    language_model = model.model.language_model
    layers = language_model.layers
    start, end = batch.image_start[0], batch.image_end[0]
    z_ref = input_embeddings(model, batch)[:, start:end]
    if rope is None:
        rotary = language_model.rotary_emb
    else:

        def rotary(hidden, positions):
            return language_model.rotary_emb(hidden, rope[..., positions[0]])

    stages: list[list[int]] = []

    def drop(index, hidden, layer_input, kept):
        if index not in prune_after:
            return None
        stage = prune_after.index(index)
        queries, keys = projections(layers[index], layer_input, kept, rotary)
        logits = queries @ keys.transpose(-1, -2) / math.sqrt(queries.shape[-1])  # [H, S', S']
        causal = torch.ones(kept.numel(), kept.numel(), dtype=torch.bool).triu(1)
        weights = torch.softmax(logits.masked_fill(causal, float("-inf")), dim=-1)
        visual = (kept >= start) & (kept < end)
        attn_row = weights.mean(dim=0)[-1][visual]  # [n] head mean, last row
        z_now = hidden[:, visual]
        score = authors_score(attn_row, z_ref, z_now, grid if stage == 0 else None, spectral)
        top = score.topk(min(keeps[stage], int(visual.sum()))).indices.sort().values
        survivors = torch.cat([kept[~visual], kept[visual][top]]).sort().values
        stages.append(kept[visual][top].tolist())
        return survivors

    run_layers(model, batch, drop, rope)
    return stages


@pytest.fixture(scope="module")
def llava():
    size = LLAVA_GRID[0] * 7
    return tiny_llava(attn="eager", image_size=size, patch_size=7, text={"num_hidden_layers": LLAVA_DEPTH})


def _library_stages(model, batch, budget, **settings) -> list[list[int]]:
    with priortr.apply(model, method="clse", budget=budget, **settings) as handle, torch.no_grad():
        model(**batch.kwargs())
    return [stage.kept[0].tolist() for stage in handle.last.stages], [s.layer for s in handle.last.stages]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_llava_presets_keep_the_authors_tokens_at_every_stage(llava, seed):
    batch = llava_batch(llava, 1, seed=seed, text_after=(6,))
    for budget, keeps in ((64, [110, 70, 20]), (128, [220, 140, 41]), (192, [330, 210, 62])):
        kept, layers = _library_stages(llava, batch, budget)
        assert layers == [0, 1, 3]
        assert [len(stage) for stage in kept] == keeps
        assert kept == official_stages(llava, batch, keeps, LLAVA_SCORED, LLAVA_GRID)


def test_llava_without_the_spectral_factor_keeps_other_tokens(llava):
    """Negative control: the authors' stages ranked by attention alone differ from CLSE's."""
    differs = 0
    for seed in range(3):
        batch = llava_batch(llava, 1, seed=seed, text_after=(6,))
        kept, _ = _library_stages(llava, batch, 64)
        differs += (
            kept[0]
            != official_stages(llava, batch, [110, 70, 20], LLAVA_SCORED, LLAVA_GRID, spectral=False)[0]
        )
    assert differs >= 1


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen2_vl(attn="eager")


QWEN_SCORED = [0, 1, 2]  # 4 layers: the authors' [1, round(1.44), round(2.68)] = [1, 1, 3] made increasing
QWEN_PRESETS = {0.112: (0.19, 0.12, 0.034), 0.223: (0.38, 0.24, 0.066), 0.334: (0.57, 0.36, 0.098)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qwen_ratio_presets_keep_the_authors_tokens_at_every_stage(qwen, seed):
    batch = qwen_batch(qwen, 1, QWEN_GRID, seed, text_after=(6,))
    n_visual = batch.image_end[0] - batch.image_start[0]
    rope = rope_positions(qwen, batch)
    for ratio, shares in QWEN_PRESETS.items():
        keeps = [max(1, int(n_visual * share)) for share in shares]
        kept, layers = _library_stages(qwen, batch, ratio)
        assert layers == QWEN_SCORED
        assert [len(stage) for stage in kept] == keeps
        assert kept == official_stages(qwen, batch, keeps, QWEN_SCORED, (12, 18), rope=rope)


def test_qwen_transposed_grid_keeps_other_tokens(qwen):
    """Negative control: the authors' stages on the transposed grid (18 x 12) keep other tokens."""
    differs = 0
    for seed in range(3):
        batch = qwen_batch(qwen, 1, QWEN_GRID, seed, text_after=(6,))
        kept, _ = _library_stages(qwen, batch, 0.112)
        keeps = [len(stage) for stage in kept]
        rope = rope_positions(qwen, batch)
        differs += kept[0] != official_stages(qwen, batch, keeps, QWEN_SCORED, (18, 12), rope=rope)[0]
    assert differs >= 1


def rope_positions(model, batch) -> torch.Tensor:
    """[3, 1, S] the M-RoPE ids the stock model gives its language model (the text row dropped)."""
    positions = language_model_inputs(model, batch)["position_ids"]
    return positions[1:] if positions.shape[0] == 4 else positions


def test_a_count_budget_without_a_preset_follows_the_authors_fallback():
    """K = 100: int(1.72 K), int(1.09 K), int(0.32 K) (the authors' ``_schedule`` fallback)."""
    from priortr.methods.clse import clse_stages

    assert clse_stages(100, 576, 32) == [(0, 172), (10, 109), (20, 32)]
    assert clse_stages(64, 576, 28) == [(0, 110), (9, 70), (18, 20)]
    assert clse_stages(0.112, 1000, 36) == [(0, 190), (12, 120), (23, 34)]
    assert clse_stages(64, 100, 32) == []  # the first stage would keep every token
