"""Analytic FLOPs and KV-cache size of multimodal inference with visual-token pruning.

The protocol is the paper's (PriorTR, Appendix "Efficiency Analysis", "FLOPs computation"), which
follows FastV (Chen et al., ECCV 2024). Per LLaMA-style decoder layer, for P tokens,

    F(P) = 8 P D^2 + 2 P^2 D + 6 P D H                      (Q/K/V/O projections, attention, SwiGLU MLP)

with D the hidden size and H the MLP's intermediate size, and for a method that prunes the visual
tokens to K after the first L layers,

    FLOPs_LLM = L * F(P) + (T - L) * F(P_text + K)           (T decoder layers)

Totals "further include the ViT encoder, projector, autoregressive decode, and LM head", each
counted here in the same style (matrix multiplications only; norms, activations, softmax, RoPE and
residual additions are left out, as in FastV):

- ViT: the same layer formula with the tower's own D and H; a two-matrix GELU MLP is 4 P D H (CLIP,
  Qwen2-VL), a SwiGLU MLP 6 P D H (Qwen2.5-VL), windowed blocks attend within their window; plus the
  patch embedding (a matmul over each patch's pixels). Every layer the stock model runs is counted
  (transformers runs all CLIP layers even though LLaVA reads the penultimate one).
- projector: LLaVA's two-layer MLP, 2 N (Dv D + D D); Qwen's patch merger, 2 N ((4 Dv)^2 + 4 Dv D).
- decode: each decode step runs one new token through every layer: the linear terms for one token
  plus attention over that layer's cache (prompt tokens kept in the cache + the steps so far).
- LM head: 2 D V per row of logits. ``generate()`` asks the prefill for the last position's logits
  only (``logits_to_keep=1``), so the prefill contributes one row and every decode step one row.

Layer convention. In this package ``layer`` is the 0-indexed decoder layer whose attention is
scored: layers ``0 .. layer`` run on all tokens and layers ``layer+1 ..`` on text + K, so the
paper's L ("full layers", ``full_layers`` here) is ``layer + 1``; ``layer=2`` means L = 3. FastV's
``K=2`` means two full layers (L = 2), as does the paper's Eq. with L = 2. The engine prunes the KV
cache of layers ``0 .. layer`` as well, so every layer caches text + K tokens after a pruned prefill.
Without a ``layer``, each method is counted at the layer ``priortr.apply`` scores for it by default
(``MethodInfo.default_layer``: PriorTR ``DEFAULT_LAYER`` = 2, FastV its registered 1), so a report's rows are
what the library runs.

Methods. Every registered method whose token counts follow from its schedule is counted, with the
stages the engine runs (``PruningConfig.schedule``, at the method's default options): one-layer
methods cut after their scored layer, multi-stage methods (CLSE, PyramidDrop) after each stage, and
the methods that prune before the language model (VisionZip, DivPrune, ...) before layer 0, after
the vision tower and the projector have run on every visual token, as the engine does (VisionZip
leaves K - 1: ``CLS_TAKES_A_SLOT``; downsample the rows x columns <= K of its pooled grid, on the square
grid of the image's tokens: ``POOLS_A_GRID``). The ``pdrop`` rows alone keep PyramidDrop's own cache (each
layer caches what it processed, the paper's PDrop KV-cache column); every other row has this
package's compacted cache. SparseVLM is not counted: it recycles clusters on top of its schedule's
counts (``priortr bench`` measures the tokens it leaves).

The paper's own FLOPs and KV-cache columns, and the assumptions that reproduce them, are not part of
the library: ``benchmarks/paper_flops.py`` in the repository.

``exact=True`` replaces the paper's formula, which assumes multi-head attention and counts one
P x P x D product (or both in multiply-accumulates), by an exact count at 2 FLOPs per
multiply-accumulate: Q and O projections 4 P D A, K and V projections 4 P D D_kv (D_kv = KV heads x
head size, so grouped-query models such as Qwen2.5-VL are not over-counted), attention 4 P P_k A
(scores and weighted sum; A = heads x head size), MLP 2 m P D H (m = 3 for SwiGLU, 2 for GELU).
Prefill attention is counted over the full P x P square in both modes (dense kernels compute it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from transformers import PretrainedConfig

from priortr import compat
from priortr.engine.config import PruningConfig, resolve_budget
from priortr.frontend.configs import load_config
from priortr.methods import available_methods, get_method
from priortr.methods.downsample import pooled_grid
from priortr.methods.pdrop import pyramid_stages
from priortr.methods.registry import DEFAULT_LAYER

TERMS: tuple[str, ...] = ("vit", "projector", "llm_prefill", "decode", "lm_head")
NOT_COUNTED = {
    "sparsevlm": "it recycles clusters on top of its schedule's counts; `priortr bench --methods sparsevlm` "
    "measures the tokens it leaves",
}
"""Registered methods whose kept counts the schedule alone does not give, and why."""
METHODS: tuple[str, ...] = tuple(name for name in available_methods() if name not in NOT_COUNTED)
"""The methods ``flops_report`` counts."""
CLS_TAKES_A_SLOT = frozenset({"visionzip"})
"""Methods that leave K - 1 of a budget K < N at their defaults: VisionZip counts the tower's [CLS], which
LLaVA drops, as one of its K (``cls_takes_a_slot=True``, the authors' patch set)."""
POOLS_A_GRID = frozenset({"downsample"})
"""Methods that leave the rows x columns <= K of the grid they pool an image's token grid to
(``priortr.methods.downsample.pooled_grid``); counted on a square grid of the image's tokens."""
DEFAULT_BUDGETS: tuple[int, ...] = (192, 128, 64)
DEFAULT_TEXT_TOKENS = 48
DEFAULT_DECODE_STEPS = 63
DYNAMIC_IMAGE_TOKENS = 576  # Qwen-VL default: a 672 x 672 image = 48 x 48 patches = 24 x 24 merged tokens


# -- shapes read from a transformers config -----------------------------------------------------------


@dataclass(frozen=True)
class TextShape:
    """Shape of the language model (decoder layers and LM head)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    mlp_matrices: int = 3  # SwiGLU: gate, up, down
    cache_caps: tuple[int | None, ...] = ()  # per layer: None keeps every token, w a window's w, 0 nothing

    def cached(self, tokens: int) -> list[int]:
        """Tokens each layer's (dynamic) cache holds for ``tokens`` processed: all of them for full
        attention, the last ``window - 1`` for a sliding or chunked layer, none for linear attention
        (a fixed-size state that pruning leaves as it is)."""
        caps = self.cache_caps or (None,) * self.layers
        return [tokens if cap is None else min(tokens, cap) for cap in caps]

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class VisionShape:
    """Shape of the vision tower and projector; token counts are per image."""

    family: str  # "clip" (LLaVA), "qwen2_vl", "qwen2_5_vl"
    hidden: int
    intermediate: int
    layers: int
    patch_pixels: int  # inputs of one patch: channels x temporal patch x patch size^2
    mlp_matrices: int  # 2 for a GELU MLP, 3 for SwiGLU
    merge: int = 1  # patches merged into one LLM token per side (Qwen: 2, i.e. 4 patches per token)
    cls_token: bool = False  # CLIP prepends a class token to the patches
    drops_first: bool = False  # LLaVA's "default" feature strategy drops the class token
    fixed_patches: int | None = None  # fixed-resolution towers: patches per image
    window_tokens: int | None = None  # windowed attention: patches per window
    full_attention_layers: frozenset[int] = field(default_factory=frozenset)

    def llm_tokens(self, patches: int) -> int:
        """Visual tokens the language model receives for ``patches`` patches."""
        tokens = patches + self.cls_token - self.drops_first
        return tokens // (self.merge * self.merge)


@dataclass(frozen=True)
class ModelShape:
    """Everything the FLOPs count needs from a multimodal config."""

    model_type: str
    text: TextShape
    vision: VisionShape

    @property
    def default_image_tokens(self) -> int:
        if self.vision.fixed_patches is not None:
            return self.vision.llm_tokens(self.vision.fixed_patches)
        return DYNAMIC_IMAGE_TOKENS

    def patches_for(self, image_tokens: int) -> int:
        """Patches the vision tower encodes to give ``image_tokens`` LLM tokens."""
        if self.vision.fixed_patches is not None:
            if image_tokens != self.default_image_tokens:
                raise ValueError(
                    f"{self.model_type} encodes a fixed {self.default_image_tokens} visual tokens per image, "
                    f"not {image_tokens}"
                )
            return self.vision.fixed_patches
        return image_tokens * self.vision.merge * self.vision.merge


UNMODELLED_TEXT = {
    "gemma4_text": "its global layers have their own head size and KV heads, and its on-device shapes add "
    "per-layer inputs and layers that share another layer's keys",
}
"""Decoder types whose layers this one-shape-per-model count does not describe, and why."""


def text_shape(config: PretrainedConfig) -> TextShape:
    """The language model's shape (``config.get_text_config()``); refuses a decoder whose layers it does
    not describe (``UNMODELLED_TEXT``)."""
    text = config.get_text_config(decoder=True)
    if text.model_type in UNMODELLED_TEXT:
        raise ValueError(
            f"priortr's FLOPs and KV-cache count does not model {text.model_type}: "
            f"{UNMODELLED_TEXT[text.model_type]}. Pruning it is supported; measure its costs on the device"
        )
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kinds, windows = compat.layers.types(text), compat.layers.windows(text)
    caps = tuple(
        0 if kind in compat.layers.STATE_KINDS else None if window is None else window.size - 1
        for kind, window in zip(kinds, windows, strict=True)
    )
    return TextShape(
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab=text.vocab_size,
        cache_caps=caps if any(cap is not None for cap in caps) else (),
    )


def _clip_like(config: PretrainedConfig) -> VisionShape:
    vision = config.vision_config
    grid = vision.image_size // vision.patch_size
    cls = vision.model_type == "clip_vision_model"
    return VisionShape(
        family="clip",
        hidden=vision.hidden_size,
        intermediate=vision.intermediate_size,
        layers=vision.num_hidden_layers,
        patch_pixels=getattr(vision, "num_channels", 3) * vision.patch_size**2,
        mlp_matrices=2,
        cls_token=cls,
        drops_first=getattr(config, "vision_feature_select_strategy", "default") == "default",
        fixed_patches=grid * grid,
    )


def _qwen2_vl(config: PretrainedConfig) -> VisionShape:
    vision = config.vision_config
    return VisionShape(
        family="qwen2_vl",
        hidden=vision.embed_dim,
        intermediate=int(vision.embed_dim * vision.mlp_ratio),
        layers=vision.depth,
        patch_pixels=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
        mlp_matrices=2,
        merge=vision.spatial_merge_size,
    )


def _qwen2_5_vl(config: PretrainedConfig) -> VisionShape:
    vision = config.vision_config
    window = (vision.window_size // vision.patch_size) ** 2
    return VisionShape(
        family="qwen2_5_vl",
        hidden=vision.hidden_size,
        intermediate=vision.intermediate_size,
        layers=vision.depth,
        patch_pixels=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
        mlp_matrices=3,
        merge=vision.spatial_merge_size,
        window_tokens=window,
        full_attention_layers=frozenset(vision.fullatt_block_indexes),
    )


VISION_READERS = {"llava": _clip_like, "qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl}


def model_shape(config: PretrainedConfig | str) -> ModelShape:
    """Shapes of a LLaVA, Qwen2-VL or Qwen2.5-VL config (or of a name/path ``load_config`` accepts)."""
    if isinstance(config, str):
        config = load_config(config)
    reader = VISION_READERS.get(config.model_type)
    if reader is None:
        raise ValueError(
            f"no FLOPs model for model_type {config.model_type!r}; supported: {', '.join(VISION_READERS)}"
        )
    return ModelShape(config.model_type, text_shape(config), reader(config))


# -- per-layer formulas ------------------------------------------------------------------------------


def layer_flops(
    tokens: int,
    hidden: int,
    intermediate: int,
    *,
    keys: int | None = None,
    attn_dim: int | None = None,
    kv_dim: int | None = None,
    mlp_matrices: int = 3,
    exact: bool = False,
) -> int:
    """FLOPs of one transformer layer: ``tokens`` queries attending to ``keys`` keys (default: themselves).

    ``exact=False`` is the paper's Eq. (Appendix "FLOPs computation"), extended to keys != queries:
    ``8 q D^2 + 2 q k D + 2 m q D H``, i.e. ``F(P) = 8 P D^2 + 2 P^2 D + 6 P D H`` for a SwiGLU MLP
    (m = 3) with q = k = P. It assumes multi-head attention (K/V projections as wide as Q).
    ``exact=True`` counts 2 FLOPs per multiply-accumulate: ``4 q D A + 4 q D D_kv + 4 q k A + 2 m q D H``
    with A = ``attn_dim`` and D_kv = ``kv_dim`` (both default to D).
    """
    keys = tokens if keys is None else keys
    mlp = 2 * mlp_matrices * tokens * hidden * intermediate
    if not exact:
        return 8 * tokens * hidden * hidden + 2 * tokens * keys * hidden + mlp
    attn_dim = hidden if attn_dim is None else attn_dim
    kv_dim = hidden if kv_dim is None else kv_dim
    projections = 4 * tokens * hidden * attn_dim + 4 * tokens * hidden * kv_dim
    return projections + 4 * tokens * keys * attn_dim + mlp


def decoder_layer_flops(text: TextShape, tokens: int, keys: int | None = None, exact: bool = False) -> int:
    """``layer_flops`` with the language model's shape."""
    return layer_flops(
        tokens,
        text.hidden,
        text.intermediate,
        keys=keys,
        attn_dim=text.attn_dim,
        kv_dim=text.kv_dim,
        mlp_matrices=text.mlp_matrices,
        exact=exact,
    )


def llm_prefill_flops(
    config: PretrainedConfig | ModelShape | str,
    tokens: int,
    pruned_tokens: int,
    full_layers: int,
    *,
    exact: bool = False,
) -> int:
    """The paper's ``FLOPs_LLM = L F(P) + (T - L) F(P_hat)`` with L = ``full_layers``, P = ``tokens``, P_hat =
    ``pruned_tokens``; ``full_layers = T`` is the unpruned prefill. With this package's ``layer``,
    ``full_layers = layer + 1``."""
    text = _text(config)
    if not 0 <= full_layers <= text.layers:
        raise ValueError(f"full_layers must be in [0, {text.layers}], got {full_layers}")
    full = full_layers * decoder_layer_flops(text, tokens, exact=exact)
    return full + (text.layers - full_layers) * decoder_layer_flops(text, pruned_tokens, exact=exact)


def kv_cache_bytes(
    config: PretrainedConfig | ModelShape | str,
    tokens: int,
    dtype_bytes: int = 2,
    batch: int = 1,
    *,
    pruned_from: int | None = None,
    full_tokens: int | None = None,
) -> int:
    """Bytes of the KV cache: ``2 x kv_heads x head_dim x dtype_bytes x batch`` per token a layer holds.

    A full-attention layer holds every token, a sliding or chunked one its window's last tokens, a
    linear-attention layer none (its fixed-size state is not counted: pruning leaves it as it is;
    ``TextShape.cached``). With ``pruned_from=None`` every layer caches ``tokens`` (this package's engine
    prunes the cache of layers 0..L too). With ``pruned_from=j`` layers ``0 .. j-1`` cache ``full_tokens``
    and layers ``j ..`` cache ``tokens`` (a method that leaves the early layers' cache unpruned).
    """
    text = _text(config)
    per_token_layer = 2 * text.kv_heads * text.head_dim * dtype_bytes * batch
    if pruned_from is None:
        return per_token_layer * sum(text.cached(tokens))
    if full_tokens is None or not 0 <= pruned_from <= text.layers:
        raise ValueError("pruned_from needs full_tokens and must be in [0, layers]")
    early, late = text.cached(full_tokens)[:pruned_from], text.cached(tokens)[pruned_from:]
    return per_token_layer * (sum(early) + sum(late))


def _shape(config: PretrainedConfig | ModelShape | str) -> ModelShape:
    return config if isinstance(config, ModelShape) else model_shape(config)


def _text(config: PretrainedConfig | ModelShape | str) -> TextShape:
    """The language model's shape; unlike ``_shape`` this accepts any decoder config."""
    if isinstance(config, ModelShape):
        return config.text
    return text_shape(load_config(config) if isinstance(config, str) else config)


# -- layer profiles: how many visual tokens each decoder layer sees -------------------------------------


@dataclass(frozen=True)
class LayerProfile:
    """Visual tokens per decoder layer: from 0-indexed layer ``cuts[i][0]`` on, ``cuts[i][1]`` are kept.

    A cut names the first layer that runs on fewer tokens, one after the scored layer of a method's
    stages (``priortr.methods.Schedule`` and ``stages=``: (scored layer, kept)); ``profile_of_stages``
    converts. ``compact_cache=True``: after the prefill every layer's KV cache holds only the finally
    kept tokens (this package's engine). ``False``: each layer caches the tokens it processed
    (PyramidDrop). No cuts is the unpruned model.
    """

    name: str
    cuts: tuple[tuple[int, int], ...] = ()
    compact_cache: bool = True

    def visual_per_layer(self, n_visual: int, n_layers: int) -> list[int]:
        """Visual tokens processed by each decoder layer during the prefill."""
        counts = [n_visual] * n_layers
        previous_layer, previous_kept = -1, n_visual
        for first, kept in self.cuts:
            if not previous_layer < first <= n_layers or kept < 0:
                raise ValueError(f"cuts must have increasing layers in [0, {n_layers}]: {self.cuts}")
            kept = min(kept, previous_kept)
            counts[first:] = [kept] * (n_layers - first)
            previous_layer, previous_kept = first, kept
        return counts

    def cached_per_layer(self, n_visual: int, n_layers: int) -> list[int]:
        """Visual tokens each layer's KV cache holds after the prefill."""
        counts = self.visual_per_layer(n_visual, n_layers)
        return [counts[-1]] * n_layers if self.compact_cache else counts


def profile_of_stages(
    stages: Sequence[tuple[int, int]], name: str = "stages", compact_cache: bool = True
) -> LayerProfile:
    """The profile of the engine's ``stages`` [(scored layer, kept)]: each cut one layer later (layer -1,
    pruning before the first decoder layer, cuts at 0)."""
    return LayerProfile(name, tuple((layer + 1, kept) for layer, kept in stages), compact_cache)


def single_cut(kept: int, full_layers: int, name: str = "priortr") -> LayerProfile:
    """One pruning step: ``full_layers`` layers on all tokens, the rest on ``kept`` (cache compacted)."""
    return LayerProfile(name, ((full_layers, kept),))


def priortr_profile(kept: int, layer: int = DEFAULT_LAYER, name: str = "priortr") -> LayerProfile:
    """This package's engine: score at 0-indexed ``layer``, so ``layer + 1`` layers run on all tokens."""
    return single_cut(kept, layer + 1, name)


def pyramid_drop_profile(kept: int, n_visual: int, n_layers: int, stages: int = 4) -> LayerProfile:
    """PyramidDrop's stages (``priortr.methods.pdrop.pyramid_stages``) with each layer caching what it
    processed, as the original implementation does: the profile the paper's PDrop KV-cache column
    implies. (This package's engine compacts every layer's cache instead.)"""
    return profile_of_stages(pyramid_stages(kept, n_visual, n_layers, stages), "pdrop", compact_cache=False)


def scheduled_prefill_flops(
    config: PretrainedConfig | ModelShape | str,
    text_tokens: int,
    n_visual: int,
    stages: Sequence[tuple[int, int]],
    *,
    exact: bool = False,
) -> int:
    """Language-model prefill FLOPs of one prompt under the engine's ``stages`` [(scored layer, kept)],
    layer -1 pruning before the first decoder layer (the methods' ``Schedule`` convention)."""
    text = _text(config)
    counts = profile_of_stages(stages).visual_per_layer(n_visual, text.layers)
    return sum(decoder_layer_flops(text, text_tokens + count, exact=exact) for count in counts)


def method_profile(
    method: str, budget: int | float, shape: ModelShape, n_visual: int, layer: int | None = None
) -> LayerProfile:
    """The profile of ``method`` at ``budget`` (a count or a ratio, as ``priortr.apply``'s) for one image
    of ``n_visual`` tokens: the stages the engine runs (``PruningConfig.schedule``), a one-layer method
    scored at ``layer`` (None: its default). "pdrop" keeps PyramidDrop's own cache
    (``pyramid_drop_profile``)."""
    if method in NOT_COUNTED:
        raise ValueError(f"priortr flops does not count {method}: {NOT_COUNTED[method]}")
    n_layers = shape.text.layers
    if method == "pdrop":
        return pyramid_drop_profile(resolve_budget(budget, n_visual), n_visual, n_layers)
    stages = PruningConfig.of(method, budget, layer, n_layers=n_layers).schedule(n_visual, n_layers)
    if method in CLS_TAKES_A_SLOT:
        if stages[0][1] == 1:
            raise ValueError(f"{method}: a budget of 1 leaves no patch once [CLS] takes its slot")
        stages = [(scored, kept - 1 if kept < n_visual else kept) for scored, kept in stages]
    if method in POOLS_A_GRID:
        stages = [(scored, pooled_count(kept, n_visual)) for scored, kept in stages]
    return profile_of_stages(stages, method)


def pooled_count(budget: int, n_visual: int) -> int:
    """Tokens left when a square grid of ``n_visual`` tokens is pooled for ``budget`` (``downsample``:
    169 of 576 for K = 192); a count that is no square grid has no grid to pool."""
    side = math.isqrt(n_visual)
    if side * side != n_visual:
        raise ValueError(
            f"downsample pools an image's token grid, and {n_visual} tokens are no square grid; count it "
            "with a square number of image tokens (--image-tokens 576)"
        )
    rows, cols = pooled_grid(side, side, budget)
    return rows * cols


# -- totals ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopsBreakdown:
    """FLOPs of one inference (one image, batch 1), by term."""

    vit: int
    projector: int
    llm_prefill: int
    decode: int
    lm_head: int

    def total(self, terms: Iterable[str] = TERMS) -> int:
        return sum(getattr(self, term) for term in terms)

    def as_dict(self, terms: Iterable[str] = TERMS) -> dict[str, int]:
        return {**asdict(self), "total": self.total(terms)}


def vit_flops(shape: ModelShape, image_tokens: int, exact: bool = False) -> int:
    """Patch embedding plus every vision block, for one image giving ``image_tokens`` LLM tokens."""
    vision = shape.vision
    patches = shape.patches_for(image_tokens)
    tokens = patches + vision.cls_token
    total = 2 * patches * vision.patch_pixels * vision.hidden
    for index in range(vision.layers):
        windowed = vision.window_tokens is not None and index not in vision.full_attention_layers
        keys = min(tokens, vision.window_tokens) if windowed else tokens
        total += layer_flops(
            tokens,
            vision.hidden,
            vision.intermediate,
            keys=keys,
            mlp_matrices=vision.mlp_matrices,
            exact=exact,
        )
    return total


def projector_flops(shape: ModelShape, image_tokens: int) -> int:
    """LLaVA's 2-layer MLP ``2 N (Dv D + D D)``, or Qwen's merger ``2 N ((m^2 Dv)^2 + m^2 Dv D)``."""
    vision, hidden = shape.vision, shape.text.hidden
    merged = vision.merge * vision.merge * vision.hidden
    if vision.family == "clip":
        return 2 * image_tokens * (vision.hidden * hidden + hidden * hidden)
    return 2 * image_tokens * (merged * merged + merged * hidden)


def decode_flops(text: TextShape, cached: Sequence[int], steps: int, exact: bool = False) -> int:
    """``steps`` one-token forward passes; step s (1-based) attends, in layer l, to ``cached[l] + s`` keys."""
    base = decoder_layer_flops(text, 1, keys=0, exact=exact)  # the formula is linear in the keys
    per_key = decoder_layer_flops(text, 1, keys=1, exact=exact) - base
    keys = sum(steps * prompt_cached + steps * (steps + 1) // 2 for prompt_cached in cached)
    return len(cached) * steps * base + per_key * keys


def inference_flops(
    config: PretrainedConfig | ModelShape | str,
    profile: LayerProfile | None = None,
    *,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    decode_steps: int = DEFAULT_DECODE_STEPS,
    image_tokens: int | None = None,
    exact: bool = False,
    all_prefill_logits: bool = False,
) -> FlopsBreakdown:
    """FLOPs of one generation: ViT, projector, LLM prefill under ``profile`` (None: unpruned), then
    ``decode_steps`` decode steps, and the LM head (last prefill row, or every row that leaves the last
    layer with ``all_prefill_logits``, plus one row per step). ``text_tokens`` counts every prompt token
    that is not visual (template, separator, question)."""
    shape = _shape(config)
    text = shape.text
    n_visual = shape.default_image_tokens if image_tokens is None else image_tokens
    if text_tokens < 0 or decode_steps < 0 or n_visual < 1:
        raise ValueError("text_tokens and decode_steps must be >= 0 and image_tokens >= 1")
    profile = profile or LayerProfile("vanilla")
    visual = profile.visual_per_layer(n_visual, text.layers)
    cached = [text_tokens + kept for kept in profile.cached_per_layer(n_visual, text.layers)]
    prefill_rows = text_tokens + visual[-1] if all_prefill_logits else 1
    return FlopsBreakdown(
        vit=vit_flops(shape, n_visual, exact),
        projector=projector_flops(shape, n_visual),
        llm_prefill=sum(decoder_layer_flops(text, text_tokens + kept, exact=exact) for kept in visual),
        decode=decode_flops(text, cached, decode_steps, exact),
        lm_head=2 * text.hidden * text.vocab * (prefill_rows + decode_steps),
    )


def cache_bytes(
    shape: ModelShape, profile: LayerProfile | None, text_tokens: int, n_visual: int, dtype_bytes: int = 2
) -> int:
    """KV-cache bytes right after the prefill under ``profile`` (batch 1), each layer holding what its
    kind keeps of the tokens it caches (``TextShape.cached``)."""
    profile = profile or LayerProfile("vanilla")
    per_layer = profile.cached_per_layer(n_visual, shape.text.layers)
    text = shape.text
    per_token = 2 * text.kv_heads * text.head_dim * dtype_bytes
    held = (text.cached(text_tokens + kept)[index] for index, kept in enumerate(per_layer))
    return per_token * sum(held)


def layer_mapping(layer: int, n_layers: int, text_tokens: int, n_visual: int) -> str:
    """One line saying which layers run on which tokens for this package's ``layer``."""
    full = layer + 1
    return (
        f"layer={layer} (0-indexed scored layer): layers 0..{layer} ({full} layers, L = {full} in the "
        f"paper's Eq.) run on all {text_tokens + n_visual} tokens; layers {full}..{n_layers - 1} "
        f"({n_layers - full} layers) on {text_tokens} text + K visual tokens"
    )


# -- report ------------------------------------------------------------------------------------------


def flops_report(
    config: PretrainedConfig | ModelShape | str,
    budgets: Sequence[int | float] = DEFAULT_BUDGETS,
    *,
    methods: Sequence[str] = ("priortr",),
    layer: int | None = None,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    decode_steps: int = DEFAULT_DECODE_STEPS,
    image_tokens: int | None = None,
    full_layers: int | None = None,
    exact: bool = False,
    all_prefill_logits: bool = False,
    terms: Sequence[str] = TERMS,
    dtype_bytes: int = 2,
) -> dict[str, Any]:
    """FLOPs of vanilla and of each method x budget, by term, with the percentage of vanilla (JSON-ready).

    ``config``: a config, a shipped name or a checkpoint path. ``budgets``: token counts K or ratios
    in (0, 1) of the image's tokens (as ``priortr.apply``). ``layer``: this package's 0-indexed scored
    layer for every one-layer method; None, as ``priortr.apply``, gives each its own
    (``MethodInfo.default_layer``: PriorTR 2, FastV 1). ``full_layers`` overrides ``layer + 1``.
    ``terms``: the terms summed into ``total`` and the percentage (all by default). The KV cache is
    reported for ``dtype_bytes``.
    ``methods``: any of ``METHODS``, each at its default options.
    Each row names its scored ``layer`` and ``full_layers`` (None for a method of several stages or
    one that prunes before the language model), its ``kept`` (the budget as a count: a staged method's
    schedule name) and its ``cuts`` (``LayerProfile``: what each stage keeps).
    """
    name = config if isinstance(config, str) else getattr(config, "name_or_path", "") or config.model_type
    shape = _shape(config)
    n_visual = shape.default_image_tokens if image_tokens is None else image_tokens
    unknown = sorted(set(terms) - set(TERMS))
    if unknown:
        raise ValueError(f"unknown terms {unknown}; choose from {', '.join(TERMS)}")
    common = {
        "text_tokens": text_tokens,
        "decode_steps": decode_steps,
        "image_tokens": n_visual,
        "exact": exact,
        "all_prefill_logits": all_prefill_logits,
    }
    vanilla = inference_flops(shape, None, **common)
    vanilla_total = vanilla.total(terms)
    rows = []
    for method in methods:
        for budget in budgets:
            scored = _scored_layer(method, layer, full_layers, shape.text.layers)
            profile = method_profile(method, budget, shape, n_visual, scored)
            flops = inference_flops(shape, profile, **common)
            rows.append(
                {
                    "method": method,
                    "budget": budget,
                    "kept": resolve_budget(budget, n_visual),
                    "layer": scored,
                    "full_layers": None if scored is None else scored + 1,
                    "cuts": [list(cut) for cut in profile.cuts],
                    "flops": flops.as_dict(terms),
                    "percent": 100 * flops.total(terms) / vanilla_total,
                    "kv_cache_bytes": cache_bytes(shape, profile, text_tokens, n_visual, dtype_bytes),
                }
            )
    full = sorted({row["full_layers"] for row in rows if row["full_layers"] is not None})
    return {
        "model": name,
        "model_type": shape.model_type,
        "shapes": {
            "text": {**asdict(shape.text), "cache_caps": list(shape.text.cache_caps)},
            "vision": _vision_dict(shape.vision),
        },
        "assumptions": {
            **common,
            "layer": layer,
            "full_layers": full_layers,
            "mapping": [layer_mapping(f - 1, shape.text.layers, text_tokens, n_visual) for f in full],
            "prefill_logits": "all rows" if all_prefill_logits else "last position only (generate())",
            "terms": list(terms),
            "dtype_bytes": dtype_bytes,
            "formula": "exact (GQA-aware, 2 FLOPs per MAC)" if exact else "paper: 8PD^2 + 2P^2D + 6PDH",
        },
        "vanilla": {
            "flops": vanilla.as_dict(terms),
            "percent": 100.0,
            "kv_cache_bytes": cache_bytes(shape, None, text_tokens, n_visual, dtype_bytes),
        },
        "rows": rows,
    }


def _scored_layer(method: str, layer: int | None, full_layers: int | None, n_layers: int) -> int | None:
    """The 0-indexed scored layer of a one-layer ``method`` (None for staged and pre-LLM methods)."""
    if get_method(method).where != "layer":
        return None
    if full_layers is not None:
        layer = full_layers - 1
    elif layer is None:
        layer = get_method(method).default_layer
    if not 0 <= layer <= n_layers - 2:
        raise ValueError(f"layer must be in [0, {n_layers - 2}], got {layer}")
    return layer


def _vision_dict(vision: VisionShape) -> dict[str, Any]:
    data = asdict(vision)
    data["full_attention_layers"] = sorted(vision.full_attention_layers)
    return data


def _layer_cell(row: dict[str, Any]) -> str:
    """The scored layer of a one-layer row; another row's first pruned layers."""
    if row["layer"] is not None:
        return str(row["layer"])
    return "cuts " + "/".join(str(first) for first, _ in row["cuts"])


def _kept_cell(row: dict[str, Any]) -> str:
    """K; where the stages keep other counts (several stages: the budget names their schedule; VisionZip's
    K - 1), what each keeps as well."""
    if [kept for _, kept in row["cuts"]] in ([], [row["kept"]]):
        return str(row["kept"])
    return f"{row['kept']}: " + "/".join(str(kept) for _, kept in row["cuts"])


def _gflops(value: int) -> str:
    return f"{value / 1e9:,.1f}"


def format_table(report: dict[str, Any]) -> str:
    """Markdown: the assumptions, then one row per configuration with every term in GFLOPs."""
    assumptions = report["assumptions"]
    lines = [
        f"FLOPs of {report['model']} ({report['model_type']}), one image, batch 1; {assumptions['formula']}.",
        "",
        *(f"- {line}" for line in assumptions["mapping"]),
        f"- {assumptions['text_tokens']} text tokens, {assumptions['image_tokens']} visual tokens, "
        f"{assumptions['decode_steps']} decode steps; LM head on the {assumptions['prefill_logits']} "
        "of the prefill and one row per decode step",
        f"- total and % of vanilla sum: {', '.join(assumptions['terms'])}; "
        f"KV cache at {assumptions['dtype_bytes']} bytes per value",
        "",
        "| method | layer | K | ViT | projector | LLM prefill | decode | LM head | total | % of vanilla "
        "| KV cache (MiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    entries = [("vanilla", "-", assumptions["image_tokens"], report["vanilla"])]
    entries += [(row["method"], _layer_cell(row), _kept_cell(row), row) for row in report["rows"]]
    for method, layer, kept, entry in entries:
        flops = entry["flops"]
        cells = [_gflops(flops[term]) for term in (*TERMS, "total")]
        lines.append(
            f"| {method} | {layer} | {kept} | {' | '.join(cells)} | {entry['percent']:.1f}% "
            f"| {entry['kv_cache_bytes'] / 2**20:.1f} |"
        )
    lines.append("")
    lines.append("FLOPs columns in GFLOPs (1e9).")
    return "\n".join(lines) + "\n"


__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_DECODE_STEPS",
    "DEFAULT_LAYER",
    "DEFAULT_TEXT_TOKENS",
    "METHODS",
    "TERMS",
    "FlopsBreakdown",
    "LayerProfile",
    "ModelShape",
    "TextShape",
    "VisionShape",
    "cache_bytes",
    "decode_flops",
    "decoder_layer_flops",
    "flops_report",
    "format_table",
    "inference_flops",
    "kv_cache_bytes",
    "layer_flops",
    "layer_mapping",
    "llm_prefill_flops",
    "method_profile",
    "model_shape",
    "priortr_profile",
    "profile_of_stages",
    "projector_flops",
    "pyramid_drop_profile",
    "single_cut",
    "text_shape",
    "vit_flops",
]
