"""Prior, posterior and PriorTR score maps over the image (the paper's Figure "Qualitative comparison of
prior, posterior, and prior-corrected attention maps").

``attention_maps`` runs one pruned prefill per (layer, budget) and returns the prior Q (the separator
row), the posterior P (the instruction rows), the rule's score S and the kept set as token grids;
``render`` draws them over the part of the image that the token grid spans. Which token covers which
image region is family knowledge and lives in ``priortr.tools.families`` (``visual_grid``, ``image_view``).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from priortr.adapters import adapter_for
from priortr.api import apply
from priortr.frontend.prompts import chat_inputs
from priortr.tools import families

# Colour-bar labels of the score column, by rule; other rules get their name.
SCORE_LABELS = {
    "priortr": "S = P·log((P+ε)/(Q+ε))",
    "diff": "S = P − Q",
    "logratio": "S = log((P+ε)/(Q+ε))",
    "entropy": "S = P·log P − Q·log Q",
    "prior": "S = Q",
    "posterior": "S = P",
    "fastv": "S = last-token attention",
    "random": "S = random",
}


@dataclass(frozen=True)
class MapResult:
    """One pruned prefill's maps, each a [rows, cols] float32 grid in the image's raster order.

    Attributes:
        layer: 0-indexed decoder layer whose attention was scored.
        budget: the budget as requested (a count, or a ratio of the image's tokens).
        method: the scoring rule.
        prior, posterior: Q and P, each summing to 1 over the visual tokens.
        scores: the rule's score S (PriorTR: P·log((P+ε)/(Q+ε)), can be negative).
        kept: [rows, cols] bool, True on the kept tokens.
    """

    layer: int
    budget: int | float
    method: str
    prior: torch.Tensor
    posterior: torch.Tensor
    scores: torch.Tensor
    kept: torch.Tensor

    @property
    def grid(self) -> tuple[int, int]:
        return tuple(self.prior.shape)

    @property
    def n_visual(self) -> int:
        return self.kept.numel()

    @property
    def n_kept(self) -> int:
        return int(self.kept.sum())


def token_boxes(grid: tuple[int, int], size: tuple[int, int]) -> torch.Tensor:
    """[rows*cols, 4] float (x0, y0, x1, y1) pixel box of each token, in raster order, over an image of
    ``size`` = (width, height) split evenly into the ``grid`` = (rows, cols) of visual tokens."""
    rows, cols = grid
    width, height = size
    xs = torch.linspace(0, width, cols + 1, dtype=torch.float64)
    ys = torch.linspace(0, height, rows + 1, dtype=torch.float64)
    row, col = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    row, col = row.flatten(), col.flatten()
    return torch.stack([xs[col], ys[row], xs[col + 1], ys[row + 1]], dim=1).float()


def scores_to_grid(values: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """[N] per-token values in prompt (raster) order -> [rows, cols]: token i at (i // cols, i % cols)."""
    rows, cols = grid
    if values.ndim != 1 or values.numel() != rows * cols:
        raise ValueError(
            f"{tuple(values.shape)} values do not fill a {rows}x{cols} token grid ({rows * cols} tokens)"
        )
    return values.reshape(rows, cols)


def attention_maps(
    model: nn.Module,
    processor: Any,
    image: Any,
    prompt: str,
    layers: Sequence[int] = (2,),
    budgets: Sequence[int | float] = (64,),
    method: str = "priortr",
) -> list[MapResult]:
    """Q, P, S and the kept set of ``image`` under ``prompt``, one plain pruned prefill per (layer, budget).

    The maps of the paper's qualitative figure; ``handle.last`` of each prefill, reshaped to the token
    grid that ``families.visual_grid`` declares for the family.
    """
    adapter = adapter_for(model)
    inputs = chat_inputs(processor, image, prompt, model)
    grid = families.visual_grid(adapter, model.config, inputs, 0)
    results = []
    for layer in layers:
        for budget in budgets:
            last = _prefill(model, inputs, method, budget, layer)
            results.append(_to_maps(last, grid, layer, budget, method))
    return results


def _prefill(model: nn.Module, inputs: dict, method: str, budget: int | float, layer: int):
    """``handle.last`` of one pruned forward pass (raises if the prompt has no image to prune)."""
    with (
        apply(model, method=method, budget=budget, layer=layer, strict=True) as handle,
        torch.inference_mode(),
    ):
        model(**inputs)
        return handle.last


def _to_maps(last, grid: tuple[int, int], layer: int, budget: int | float, method: str) -> MapResult:
    """Batch row 0 of a ``PruneResult`` as [rows, cols] grids."""
    if last.scores is None:
        raise ValueError(
            f"{method} does not rank by a score over prior and posterior attention, so there are no maps "
            "to draw; priortr viz takes a scoring-rule method (priortr, fastv, posterior, ...)"
        )
    kept = torch.zeros(last.n_visual, dtype=torch.bool)
    kept[(last.kept[0] - last.visual_start[0]).cpu()] = True

    def as_grid(values: torch.Tensor) -> torch.Tensor:
        return scores_to_grid(values.detach().float().cpu(), grid)

    return MapResult(
        layer=layer,
        budget=budget,
        method=method,
        prior=as_grid(last.prior[0]),
        posterior=as_grid(last.posterior[0]),
        scores=as_grid(last.scores[0]),
        kept=scores_to_grid(kept, grid),
    )


# -- drawing ------------------------------------------------------------------------------------------

PANEL_INCHES = 2.9
MAX_PIXELS = 512
HEAT_ALPHA = 0.6
COLUMNS = ("image", "prior Q", "posterior P", "score S", "kept")


def render(results: Sequence[MapResult], image_view: Any, path: str | Path, title: str | None = None) -> Path:
    """One PNG in the layout of the paper's qualitative figure: a row per (layer, budget), with columns
    image, prior Q, posterior P, score S (diverging, centred at 0) and the kept tokens (pruned dimmed).

    ``image_view`` is the part of the image that the token grid spans (``families.image_view``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not results:
        raise ValueError("nothing to render: no maps")
    image = image_view.convert("RGB")
    image.thumbnail((MAX_PIXELS, MAX_PIXELS))  # a panel is ~320 px wide; drawing a photo at full size is slow
    aspect = image.size[1] / image.size[0]  # height / width
    panel_h = PANEL_INCHES * min(max(aspect, 0.5), 2.0)
    size = (len(COLUMNS) * PANEL_INCHES * 1.3, len(results) * (panel_h + 0.8) + 0.5)
    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(results), len(COLUMNS), squeeze=False)
    for row, maps in zip(axes, results, strict=True):
        _draw_row(fig, row, maps, image)
    fig.suptitle(textwrap.fill(title or _default_title(results), 150), fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    path = Path(path)
    if not path.suffix:  # matplotlib would add one itself; return the path it writes
        path = path.with_name(path.name + ".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _default_title(results: Sequence[MapResult]) -> str:
    return f"priortr {results[0].method}: prior Q, posterior P and score S over the image"


def _draw_row(fig, axes, maps: MapResult, image) -> None:
    """Image, Q, P, S and kept panels of one (layer, budget)."""
    from matplotlib.colors import CenteredNorm, Normalize
    from matplotlib.ticker import PercentFormatter

    where = f"layer {maps.layer}, K = {maps.n_kept}/{maps.n_visual}"
    _draw_image(axes[0], image, maps.grid, f"input ({maps.grid[0]}x{maps.grid[1]} tokens)\n{where}")
    gray = image.convert("L").convert("RGB")  # heat colours read true over a grey image
    for ax, values, name in ((axes[1], maps.prior, "prior Q"), (axes[2], maps.posterior, "posterior P")):
        label = f"{name[-1]}: % of visual attention\n(Σ = 100%; dashed: uniform 1/N)"
        low = _quantile(values, 0.01)
        norm = Normalize(low, max(_quantile(values, 0.99), low + 1e-12))  # a flat map is still drawable
        bar = _draw_heat(fig, ax, gray, values, "magma", norm, f"{name}\n{where}", label)
        bar.formatter = PercentFormatter(xmax=1.0)
        bar.update_ticks()
        if norm.vmin <= 1 / maps.n_visual <= norm.vmax:
            bar.ax.axhline(1 / maps.n_visual, color="cyan", linestyle="--", linewidth=1.5)
    halfrange = _quantile(maps.scores.abs(), 0.99) or 1e-12
    score_label = SCORE_LABELS.get(maps.method, f"S: {maps.method} score")
    _draw_heat(
        fig,
        axes[3],
        gray,
        maps.scores,
        "RdBu_r",
        CenteredNorm(0.0, halfrange),
        f"score S ({maps.method})\n{where}",
        score_label,
    )
    _draw_kept(axes[4], image, maps, f"kept tokens (pruned dimmed)\n{where}")


def _quantile(values: torch.Tensor, q: float) -> float:
    """Colour limits at the 1st/99th percentile, so that one attention-sink token does not wash out the
    map (the colour bar then shows an arrow for the clipped values)."""
    return float(torch.quantile(values.flatten().double(), q))


def _show(ax, image, title: str) -> None:
    """``image`` on ``ax`` in pixel coordinates (y down), titled, without ticks."""
    width, height = image.size
    ax.imshow(image, extent=(0, width, height, 0))
    ax.set_title(title, fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])


def _draw_image(ax, image, grid: tuple[int, int], title: str) -> None:
    """The image the grid spans, with the token grid faintly drawn."""
    _show(ax, image, title)
    width, height = image.size
    rows, cols = grid
    if rows * cols <= 1024:
        for x in torch.linspace(0, width, cols + 1)[1:-1].tolist():
            ax.axvline(x, color="white", linewidth=0.4, alpha=0.5)
        for y in torch.linspace(0, height, rows + 1)[1:-1].tolist():
            ax.axhline(y, color="white", linewidth=0.4, alpha=0.5)


def _draw_heat(fig, ax, image, values: torch.Tensor, cmap: str, norm, title: str, label: str):
    """``values`` as a heatmap over the image, with a labelled colour bar."""
    from matplotlib.cm import ScalarMappable

    _show(ax, image, title)
    width, height = image.size
    heat = ax.imshow(
        values.numpy(),
        extent=(0, width, height, 0),
        cmap=cmap,
        norm=norm,
        alpha=HEAT_ALPHA,
        interpolation="nearest",
    )
    clipped_high = float(values.max()) > norm.vmax
    clipped_low = float(values.min()) < norm.vmin
    extend = {(True, True): "both", (True, False): "max", (False, True): "min"}.get(
        (clipped_high, clipped_low), "neither"
    )
    solid = ScalarMappable(norm=heat.norm, cmap=heat.cmap)  # the bar in full colour, not at HEAT_ALPHA
    bar = fig.colorbar(solid, ax=ax, fraction=0.046, pad=0.03, extend=extend)
    bar.set_label(label, fontsize=7)
    bar.ax.tick_params(labelsize=6)
    bar.formatter.set_powerlimits((-2, 3))
    bar.ax.yaxis.get_offset_text().set_fontsize(6)
    bar.update_ticks()
    return bar


def _draw_kept(ax, image, maps: MapResult, title: str) -> None:
    """The image with pruned tokens dimmed and kept tokens outlined (``token_boxes``)."""
    from matplotlib.collections import PolyCollection

    _show(ax, image, title)
    width, height = image.size
    dim = torch.zeros((*maps.grid, 4))
    dim[..., 3] = (~maps.kept).float() * 0.7
    ax.imshow(dim.numpy(), extent=(0, width, height, 0), interpolation="nearest")
    boxes = token_boxes(maps.grid, image.size)[maps.kept.flatten()]
    outlines = [[(x0, y0), (x1, y0), (x1, y1), (x0, y1)] for x0, y0, x1, y1 in boxes.tolist()]
    ax.add_collection(PolyCollection(outlines, facecolors="none", edgecolors="yellow", linewidths=0.6))
