"""CLSE's pieces on hand-made inputs with hand-computed answers, and what it refuses."""

from __future__ import annotations

import pytest
import torch

import priortr
from priortr.methods.clse import clse_stages, evolution_factor, high_frequency, spectral_scores
from tests.helpers.tiny import llava_batch, tiny_llava
from tests.helpers.tiny_llava_family import tiny_llava_next
from tests.helpers.tiny_qwen3_vl import tiny_qwen3_vl


def test_a_flat_image_has_no_high_frequency_and_a_checkerboard_keeps_all_of_it():
    """A constant grid is all zero frequency, which the high-pass removes (0 everywhere); a 4 x 4
    checkerboard is all Nyquist frequency, at distance sqrt(8) from the centre, passed with weight
    1 - exp(-8 / (2 x 0.2^2)) = 1 - e^-100: every token keeps magnitude 1."""
    flat = torch.full((1, 16, 3), 2.5)
    assert torch.allclose(high_frequency(flat, (4, 4), 0.1), torch.zeros(1, 16), atol=1e-6)
    board = torch.tensor([(-1.0) ** (i + j) for i in range(4) for j in range(4)])
    tokens = board[None, :, None].expand(1, 16, 2)
    assert torch.allclose(high_frequency(tokens, (4, 4), 0.1), torch.ones(1, 16), atol=1e-6)


def test_the_evolution_factor_by_hand():
    """before = 1 everywhere, after = 1 except token 0 at 3: change 2 / (1 + 1 + 1e-6) capped at 1, the
    others 0; standardised over 4 tokens (unbiased std 0.5): token 0 at z = 1.5, the others at -0.5."""
    before = torch.ones(1, 4)
    after = torch.tensor([[3.0, 1.0, 1.0, 1.0]])
    factor = evolution_factor(before, after, 0.1)
    change = torch.tensor([1.0, 0.0, 0.0, 0.0])
    z = (change - change.mean()) / (change.std() + 1e-6)
    assert torch.allclose(factor[0], torch.sigmoid(z / 0.1))
    assert factor[0, 0] > 0.99 and factor[0, 1] < 0.01


def test_images_of_different_grids_are_filtered_each_on_its_own():
    """Two images of 12 tokens, on 3 x 4 and 4 x 3 grids: each row equals the row scored alone."""
    generator = torch.Generator().manual_seed(0)
    reference, current = (torch.randn(2, 12, 5, generator=generator) for _ in range(2))
    attention = torch.rand(2, 12, generator=generator)
    both = spectral_scores(reference, current, attention, ((3, 4), (4, 3)), 0.1, 0.1)
    for row, grid in enumerate(((3, 4), (4, 3))):
        alone = spectral_scores(
            reference[row : row + 1], current[row : row + 1], attention[row : row + 1], (grid,), 0.1, 0.1
        )
        assert torch.equal(both[row], alone[0])
    with pytest.raises(ValueError, match=r"h \* w = N = 12"):
        spectral_scores(reference, current, attention, ((3, 3), (4, 3)), 0.1, 0.1)


def test_the_schedules():
    """The authors' tables, their fallbacks, and the depths they scale."""
    assert clse_stages(64, 576, 32) == [(0, 110), (10, 70), (20, 20)]
    assert clse_stages(192, 576, 28) == [(0, 330), (9, 210), (18, 62)]
    assert clse_stages(0.223, 600, 36) == [(0, 228), (12, 144), (23, int(600 * 0.066))]
    assert clse_stages(0.2, 100, 40) == [(0, int(100 * 0.2 * 1.72)), (13, int(100 * 0.2 * 1.09)), (26, 6)]
    assert clse_stages(10, 576, 4) == [(0, 17), (1, 10), (2, 3)]  # 4 layers: [1, 1, 3] made increasing
    with pytest.raises(ValueError, match="at least 5"):
        clse_stages(10, 576, 3)


def test_refusals_name_the_reason():
    """A family without one grid per image, images ranked together, DeepStack before the last
    injection, bad knobs."""
    with pytest.raises(ValueError, match="defines no grid"):
        priortr.apply(tiny_llava_next(), method="clse")
    llava = tiny_llava()
    with pytest.raises(ValueError, match="multi_image='per_image'"):
        priortr.apply(llava, method="clse", multi_image="global")
    with pytest.raises(ValueError, match="DeepStack"):
        priortr.apply(tiny_qwen3_vl(), method="clse")
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        priortr.apply(llava, method="clse", options={"temperature": 0})
    with pytest.raises(ValueError, match="takes no layer"):
        priortr.apply(llava, method="clse", layer=1)


def test_a_grid_that_does_not_fill_the_tower_is_refused_at_the_prefill():
    """The full strategy keeps the [CLS] token: 17 tokens on a 4 x 4 grid."""
    model = tiny_llava()
    model.config.vision_feature_select_strategy = "full"
    model.config.image_seq_length = 17
    batch = llava_batch(model, 1)
    with priortr.apply(model, method="clse", budget=8), pytest.raises(ValueError, match="4 x 4 patch grid"):
        model(**batch.kwargs())
