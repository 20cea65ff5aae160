"""CLSE (cross-layer spectral evolution; the PriorTR authors' group, ECCV 2026, arXiv 2606.24165): three
stages of pruning by the last prompt token's attention, weighted at the first stage by how much each
token's high-frequency content changed between the input embeddings and the scored layer's output.

Authors' code, shipped beside PriorTR: github.com/CodeChildCZJ/PriorTR at
e442a4c14af1b333067a6b8310c9111cad922033, ``docs/CLSE.md``, ``image/LLaVA/llava/vtr/strategy/clse.py``
and ``image/Qwen2-VL/visual_token_pruning/strategy/clse.py`` (the Qwen3-VL file differs only in its
fallback depth). Their runners (``image/LLaVA/llava/vtr/model/prunable_llama.py``,
``image/Qwen2-VL/visual_token_pruning/model/prunable_qwen2_vl.py``) snapshot the image's hidden states
entering decoder layer 0 (``ref_layers=[0]``), and at prune layer k score with the attention of layer
k - 1 and its output: prune layer k is scored layer k - 1 here.
"""

from __future__ import annotations

import math

import torch

from priortr.methods.registry import register_method
from priortr.methods.selection import Selection, StageInputs, keep_all, top_k
from priortr.methods.validate import check_attention, check_budget, check_fraction, check_int

CLSE_PRUNE_LAYERS = {32: (1, 11, 21), 28: (1, 10, 19), 36: (1, 13, 24)}
"""The authors' prune layers by decoder depth (LLaVA-1.5-7B, Qwen2-VL-7B, Qwen3-VL-8B: ``docs/CLSE.md``)."""
CLSE_DEPTH_SHARES = (0.36, 0.67)
"""Other depths: prune layers [1, round(0.36 n), round(0.67 n)] (``default_prune_layers``)."""
CLSE_TOKEN_PRESETS = {64: (110, 70, 20), 128: (220, 140, 41), 192: (330, 210, 62)}
"""LLaVA's ``keep_tokens`` presets: tokens kept at each stage (``_TOKEN_DICT``, of 576)."""
CLSE_RATIO_PRESETS = {0.112: (0.19, 0.12, 0.034), 0.223: (0.38, 0.24, 0.066), 0.334: (0.57, 0.36, 0.098)}
"""Qwen's ``retain_ratio`` presets: each stage keeps int(N x ratio) of an image's N tokens
(``_RATIO_DICT``)."""
CLSE_SHAPE = (1.72, 1.09, 0.32)
"""The authors' schedule for a budget without a preset: each stage keeps the budget times these
(330 / 210 / 62 over 192), floored."""


def clse_prune_layers(n_layers: int) -> tuple[int, int, int]:
    """The authors' three prune layers for a language model of ``n_layers`` decoder layers
    (``default_prune_layers``): their table for 32, 28 and 36 layers, else [1, round(0.36 n),
    round(0.67 n)] (Python's ``round``, as theirs). Here, for models too shallow for three distinct
    layers, a layer equal to the one before it moves one later (the authors' code would prune twice at
    one layer)."""
    layers = CLSE_PRUNE_LAYERS.get(n_layers)
    if layers is None:
        layers = (1, *(max(1, round(n_layers * share)) for share in CLSE_DEPTH_SHARES))
    increasing: list[int] = []
    for layer in layers:
        increasing.append(max(layer, increasing[-1] + 1) if increasing else layer)
    return tuple(increasing)


def clse_stages(budget: int | float, n_visual: int, n_layers: int) -> list[tuple[int, int]]:
    """CLSE's schedule: [(0-indexed scored layer, visual tokens kept after it), ...] for one image of
    ``n_visual`` tokens in a model of ``n_layers`` decoder layers.

    The budget names a schedule, as the authors' one knob does (docs/CLSE.md): a count K is LLaVA's
    ``keep_tokens``, 64 / 128 / 192 its presets (110 / 70 / 20, 220 / 140 / 41, 330 / 210 / 62 tokens),
    any other K the authors' own fallback (int(1.72 K), int(1.09 K), int(0.32 K)); a ratio r is Qwen's
    ``retain_ratio``, 0.112 / 0.223 / 0.334 its presets (int(N x 0.19 / 0.12 / 0.034), ...), any other r
    int(N x 1.72 r), int(N x 1.09 r), int(N x 0.32 r). So the last stage keeps about a third of the
    budget: the budget is the schedule's name (about the visual tokens averaged over the layers), as
    SparseVLM's. Counts are clamped to [1, N] and made non-increasing (the authors' code keeps no token
    where a count floors to 0). Returns [] when the first stage would keep every token.
    """
    check_int("clse n_visual", n_visual, 1)
    check_int("clse n_layers", n_layers, 1)
    if isinstance(budget, float):
        check_fraction("clse budget", budget, open_low=True)
        shares = CLSE_RATIO_PRESETS.get(round(budget, 3), tuple(budget * share for share in CLSE_SHAPE))
        counts = [int(n_visual * share) for share in shares]
    else:
        check_int("clse budget", budget, 1)
        counts = list(CLSE_TOKEN_PRESETS.get(budget, tuple(int(budget * share) for share in CLSE_SHAPE)))
    kept: list[int] = []
    for count in counts:
        count = min(n_visual, max(1, count))
        kept.append(min(count, kept[-1]) if kept else count)
    if kept[0] >= n_visual:
        return []
    layers = [layer - 1 for layer in clse_prune_layers(n_layers)]
    if layers[-1] > n_layers - 2:
        raise ValueError(
            f"clse prunes at three decoder layers and needs at least 5, the model has {n_layers}"
        )
    return list(zip(layers, kept, strict=True))


def high_frequency(tokens: torch.Tensor, grid: tuple[int, int], cutoff: float) -> torch.Tensor:
    """Each token's high-frequency magnitude [B, N] float32 on its image's ``grid`` (h, w): the 2-D FFT of
    every channel of ``tokens`` [B, N, C] (N = h w, row-major), a Gaussian high-pass of standard
    deviation ``min(h // 2, w // 2) * cutoff`` around the centred zero frequency, the inverse FFT's
    magnitude averaged over channels (the authors' ``_spatial_spectral_score_2d``, in float32 as theirs)."""
    height, width = grid
    batch, n_tokens, channels = tokens.shape
    planes = tokens.float().transpose(1, 2).reshape(batch, channels, height, width)
    spectrum = torch.fft.fftshift(torch.fft.fft2(planes), dim=(-2, -1))
    rows = torch.arange(height, device=tokens.device)[:, None] - height // 2
    cols = torch.arange(width, device=tokens.device)[None, :] - width // 2
    sigma = min(height // 2, width // 2) * cutoff
    distance = torch.sqrt((rows**2 + cols**2).float())  # squared back below, rounded as the authors'
    high_pass = 1 - torch.exp(-(distance**2) / (2 * sigma**2))  # [h, w]
    filtered = torch.fft.ifftshift(spectrum * high_pass, dim=(-2, -1))
    return torch.fft.ifft2(filtered).abs().mean(dim=1).reshape(batch, n_tokens)


def evolution_factor(before: torch.Tensor, after: torch.Tensor, temperature: float) -> torch.Tensor:
    """sigmoid(z / temperature) of each token's relative spectral change [B, N], z standardised over the
    image's tokens (the authors' ``_get_evolution_factor``: change |a - b| / (mean b + b + 1e-6) capped
    at 1, standardised with the unbiased std + 1e-6)."""
    eps = 1e-6
    change = ((after - before).abs() / (before.mean(dim=-1, keepdim=True) + before + eps)).clamp(max=1)
    spread = change.std(dim=-1, keepdim=True) + eps
    return torch.sigmoid((change - change.mean(dim=-1, keepdim=True)) / spread / temperature)


def spectral_scores(
    reference: torch.Tensor,
    current: torch.Tensor,
    attention: torch.Tensor,
    grids: tuple[tuple[int, int], ...],
    cutoff: float,
    temperature: float,
) -> torch.Tensor:
    """The first stage's score [B, N]: ``attention`` [B, N] times the evolution factor of each image's
    tokens between ``reference`` and ``current`` [B, N, D] on its grid (images of one grid at a time)."""
    distinct = list(dict.fromkeys(grids))
    for height, width in distinct:
        if height * width != current.shape[1] or min(height, width) < 2:
            raise ValueError(
                f"clse needs each image's token grid (h, w) with h * w = N = {current.shape[1]} and "
                f"h, w >= 2 (its high-pass filter has width min(h // 2, w // 2) x cutoff); got "
                f"{(height, width)}"
            )
    if len(distinct) == 1:
        before = high_frequency(reference, distinct[0], cutoff)
        after = high_frequency(current, distinct[0], cutoff)
        return evolution_factor(before, after, temperature).to(attention.dtype) * attention
    factor = torch.empty_like(attention)
    for grid in distinct:
        rows = [index for index, other in enumerate(grids) if other == grid]
        index = torch.tensor(rows, device=attention.device)
        before = high_frequency(reference.index_select(0, index), grid, cutoff)
        after = high_frequency(current.index_select(0, index), grid, cutoff)
        factor.index_copy_(0, index, evolution_factor(before, after, temperature).to(factor.dtype))
    return factor * attention


def _check_knobs(*, cutoff: float, temperature: float) -> None:
    for name, value in (("cutoff", cutoff), ("temperature", temperature)):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(f"clse {name} must be a positive number; got {value!r}")


@register_method(
    "clse",
    where="layers",
    needs=("attention", "input_embeddings", "grid"),
    schedule=clse_stages,
    schedule_ratio=True,
    summary="last prompt token's attention, times at the first stage the change of each token's "
    "high-frequency content since the input embeddings; three stages",
    source="CLSE (ECCV 2026, arXiv 2606.24165), as shipped in the PriorTR authors' repository",
    check_knobs=_check_knobs,
)
def clse(inputs: StageInputs, *, cutoff: float = 0.1, temperature: float = 0.1) -> Selection:
    """CLSE: keep the visual tokens with the highest score, the last prompt token's head-aggregated
    attention (``inputs.attention.last``), times, at an image's first stage (where ``inputs.grids``
    gives its grid), the evolution factor of its spectral change between the input embeddings
    (``inputs.visual_embeddings``, the authors' ``ref_layers=[0]``) and the scored layer's output
    (``inputs.hidden``): :func:`spectral_scores`. ``cutoff`` and ``temperature`` are the authors'
    ``clse_cutoff_ratio`` and ``clse_temp`` (0.1 each). Later stages rank by attention alone (the
    authors: pruning has broken the grid)."""
    budget = check_budget(inputs, "clse")
    _check_knobs(cutoff=cutoff, temperature=temperature)
    check_attention(inputs, "clse")
    if budget >= inputs.n_visual:
        return keep_all(inputs)
    last = inputs.attention.last
    grids = inputs.grids
    if grids is None or all(grid is None for grid in grids):
        return top_k(last, budget)
    if any(grid is None for grid in grids) or inputs.visual_embeddings is None:
        raise ValueError(
            "clse scores an image's first stage on its token grid and its input embeddings: give every "
            "image of the group its grid (inputs.grids) and inputs.visual_embeddings"
        )
    scores = spectral_scores(inputs.visual_embeddings, inputs.hidden, last, grids, cutoff, temperature)
    return top_k(scores, budget)
