"""Downsampling (the baseline of VTC-Bench: Liao et al., "Are We Using the Right Benchmark: An Evaluation
Framework for Visual Token Compression Methods", ACL 2026, arXiv 2510.07143): each image's token grid
average-pooled to a coarser grid, before the LLM.
"""

from __future__ import annotations

import math

import torch

from priortr.methods.registry import register_method
from priortr.methods.selection import Selection, StageInputs, keep_all
from priortr.methods.validate import check_budget, same_count


def pooled_grid(height: int, width: int, budget: int) -> tuple[int, int]:
    """The grid (rows, columns) that a ``height`` x ``width`` token grid is pooled to for a budget of
    ``budget`` tokens: both sides scaled by the one factor s = sqrt(K / (h w)) and rounded down,
    ``floor(h s) = isqrt(K h // w)`` rows and ``isqrt(K w // h)`` columns (integer arithmetic), at least
    one each and never more than K tokens in all; the whole grid when K >= h w. As an image resized by
    one factor per side keeps its aspect ratio, so does the grid; the LLM receives rows x columns <= K
    tokens (a 24 x 24 grid: 13 x 13 = 169 for K = 192, 11 x 11 = 121 for 128, 8 x 8 = 64 for 64,
    5 x 5 = 25 for 32)."""
    if budget >= height * width:
        return height, width
    rows = min(max(1, math.isqrt(budget * height // width)), height, budget)
    cols = min(max(1, math.isqrt(budget * width // height)), width, budget // rows)
    return rows, cols


def _windows(
    size: int, out: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adaptive average pooling of ``size`` cells to ``out``: window i is ``[floor(i size / out),
    ceil((i + 1) size / out))`` (``torch.nn.functional.adaptive_avg_pool2d``'s windows); returns the
    1-D pooling matrix [out, size] (rows average their window) and each window's middle cell [out] (the
    lower of the two middle cells of an even window); the matrix in ``dtype``."""
    index = torch.arange(out, device=device)
    start = index * size // out
    end = ((index + 1) * size + out - 1) // out
    cells = torch.arange(size, device=device)
    inside = (cells[None] >= start[:, None]) & (cells[None] < end[:, None])  # [out, size]
    return inside.to(dtype) / (end - start).to(dtype)[:, None], (start + end - 1) // 2


def _pool_image(
    grid: tuple[int, int], budget: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's kept slots [K'] (ascending, raster order) and merge rows [K', h w] for its ``grid``."""
    height, width = grid
    rows, cols = pooled_grid(height, width, budget)
    by_row, middle_row = _windows(height, rows, dtype, device)
    by_col, middle_col = _windows(width, cols, dtype, device)
    merge = (by_row[:, None, :, None] * by_col[None, :, None, :]).reshape(rows * cols, height * width)
    slots = (middle_row[:, None] * width + middle_col[None, :]).reshape(-1)
    return slots, merge


@register_method(
    "downsample",
    where="vision",
    needs=("grid",),
    summary="each image's token grid average-pooled to a coarser grid of at most K tokens",
    source="downsampling baseline of VTC-Bench, Liao et al., ACL 2026 (arXiv 2510.07143)",
)
def downsample(inputs: StageInputs) -> Selection:
    """Downsampling: every image's visual tokens average-pooled on its token grid, before the LLM.

    VTC-Bench (Liao et al., "Are We Using the Right Benchmark: An Evaluation Framework for Visual Token
    Compression Methods", ACL 2026, arXiv 2510.07143; authors' code: github.com/Chenfei-Liao/VTC-Bench,
    ``qwen2_vl.py``, at 1c413c4fb8f5504d41a404c01ab83b2bd3d1cb95) shows that plain downsampling beats
    many compression methods. Its baseline resizes each image by one factor r per side (PIL bicubic,
    ``(w // r, h // r)``) before Qwen2-VL's or LLaVA-OneVision's processor, so the model encodes about
    1 / r^2 of the tokens, and compares it with methods at that ratio (r = 2, 3, 4, 5, 10 against
    ratios 0.25, 0.111, 0.0625, 0.04, 0.01). A library that prunes a given model's tokens cannot
    re-encode the image (a fixed-resolution tower such as LLaVA-1.5's resizes it back to 336 px), so
    this is the same operation on the token grid the language model receives: the grid (h, w) scaled by
    one factor per side (:func:`pooled_grid`: the largest such grid of at most K tokens) by adaptive
    average pooling of the LLM's input embeddings (each new token the mean of its window, the windows
    of ``adaptive_avg_pool2d``). The pooled token takes the slot of its window's middle token
    (harness rule: survivors keep their own prompt positions; the authors' smaller image has its own
    positions), in raster order.

    Deviations: pooling, not bicubic resampling, and of the tokens, not the pixels (the tower sees the
    full image); the count is rows x columns <= K, not exactly K (24 x 24 to 13 x 13 = 169 for
    K = 192). Images of a batch with the same token count and different grids must pool to the same
    count, or a ValueError asks to run them one per batch.

    Requires ``inputs.grids`` (each image's (h, w), h w = N, from the family's adapter) and
    ``inputs.hidden`` [B, N, D].
    """
    budget = check_budget(inputs, "downsample")
    grids = inputs.grids
    if grids is None or len(grids) != inputs.hidden.shape[0] or any(grid is None for grid in grids):
        raise ValueError(
            "downsample pools each image on its token grid: give every image its grid (inputs.grids, "
            "from the family's adapter)"
        )
    for grid in grids:
        if grid[0] * grid[1] != inputs.n_visual:
            raise ValueError(
                f"downsample: a {grid[0]} x {grid[1]} grid does not hold {inputs.n_visual} tokens"
            )
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    counts = [math.prod(pooled_grid(*grid, budget)) for grid in grids]
    same_count(counts, "downsample", "pooling each image's grid")
    dtype = torch.promote_types(inputs.hidden.dtype, torch.float32)
    pooled = [_pool_image(grid, budget, dtype, inputs.hidden.device) for grid in grids]
    return Selection(
        indices=torch.stack([slots for slots, _ in pooled]),
        merge=torch.stack([merge for _, merge in pooled]),
    )
