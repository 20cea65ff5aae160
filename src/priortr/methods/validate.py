"""Input checks shared by the selectors: bad evidence or knobs fail with a message naming the method."""

from __future__ import annotations

import math

import torch

from priortr.methods.selection import StageInputs
from priortr.methods.value_checks import value_checks

NO_CLS_HINT = (
    "this model's vision tower has no [CLS] token (e.g. Qwen2-VL): use divprune, dart or an in-LLM "
    "method such as sparsevlm"
)
SPLIT_HINT = "run these images one per batch"


def check_budget(inputs: StageInputs, method: str) -> int:
    """Validate ``inputs.hidden`` [B, N, D] (finite) and the budget K >= 1; return K."""
    hidden = inputs.hidden
    if hidden is None or hidden.ndim != 3:
        shape = None if hidden is None else tuple(hidden.shape)
        raise ValueError(
            f"{method} needs inputs.hidden, the visual tokens' hidden states [B, N, D], got {shape}"
        )
    if value_checks() and not torch.isfinite(hidden).all():
        raise ValueError(f"{method}: inputs.hidden contains NaN or inf; cannot compare visual tokens")
    budget = inputs.budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(
            f"{method}: inputs.budget must be an int >= 1 (visual tokens kept per image), got {budget!r}"
        )
    return budget


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` if it is an int >= ``minimum`` (not a bool); otherwise raise naming the knob."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a bool; otherwise raise naming the knob."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_fraction(name: str, value: object, *, open_low: bool = False) -> float:
    """A float knob in [0, 1] (or (0, 1] with ``open_low``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if not (0.0 < value <= 1.0 if open_low else 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in {'(0, 1]' if open_low else '[0, 1]'}, got {value!r}")
    return float(value)


def check_vision_cls(inputs: StageInputs, method: str) -> torch.Tensor:
    """The vision tower's [CLS] attention [B, N] (at least float32), or a ValueError naming what lacks."""
    cls = inputs.vision_cls
    if cls is None:
        raise ValueError(
            f"{method} needs the vision tower's [CLS] attention (inputs.vision_cls); {NO_CLS_HINT}"
        )
    expected = tuple(inputs.hidden.shape[:2])
    if tuple(cls.shape) != expected:
        raise ValueError(f"{method}: inputs.vision_cls must be [B, N] = {expected}, got {tuple(cls.shape)}")
    if value_checks() and not torch.isfinite(cls).all():
        raise ValueError(f"{method}: inputs.vision_cls contains NaN or inf")
    return cls.to(torch.promote_types(cls.dtype, torch.float32))


def check_vision(inputs: StageInputs, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The vision tower's [CLS] attention [B, N] and keys [B, H, N, d] (at least float32), or a ValueError."""
    cls = check_vision_cls(inputs, method)
    keys = inputs.vision_keys
    batch, n_visual = cls.shape
    if keys is None:
        raise ValueError(f"{method} needs the vision tower's keys (inputs.vision_keys); {NO_CLS_HINT}")
    if keys.ndim != 4 or keys.shape[0] != batch or keys.shape[2] != n_visual:
        raise ValueError(
            f"{method}: inputs.vision_keys must be [B, H, N, d] with B, N = {(batch, n_visual)}, "
            f"got {tuple(keys.shape)}"
        )
    if value_checks() and not torch.isfinite(keys).all():
        raise ValueError(f"{method}: inputs.vision_keys contains NaN or inf")
    return cls, keys.to(torch.promote_types(keys.dtype, torch.float32))


def check_features(inputs: StageInputs, method: str) -> torch.Tensor:
    """The vision tower's features before the projector [B, N, C], or a ValueError."""
    features = inputs.vision_features
    expected = tuple(inputs.hidden.shape[:2])
    if features is None:
        raise ValueError(
            f"{method} needs the vision tower's features before the projector (inputs.vision_features); "
            f"{NO_CLS_HINT}"
        )
    if features.ndim != 3 or tuple(features.shape[:2]) != expected:
        raise ValueError(
            f"{method}: inputs.vision_features must be [B, N, C] with B, N = {expected}, "
            f"got {tuple(features.shape)}"
        )
    return features


def check_vision_last(inputs: StageInputs, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's last-layer [CLS] attention [B, N] and keys [B, N, C] (at least float32), or an error."""
    cls, keys = inputs.vision_cls_last, inputs.vision_keys_last
    expected = tuple(inputs.hidden.shape[:2])
    if cls is None or keys is None:
        raise ValueError(
            f"{method} needs the vision tower's last-layer [CLS] attention and keys (inputs.vision_cls_last, "
            f"inputs.vision_keys_last); {NO_CLS_HINT}"
        )
    if tuple(cls.shape) != expected or keys.ndim != 3 or tuple(keys.shape[:2]) != expected:
        raise ValueError(
            f"{method}: inputs.vision_cls_last must be [B, N] = {expected} and inputs.vision_keys_last "
            f"[B, N, C], got {tuple(cls.shape)} and {tuple(keys.shape)}"
        )
    if value_checks() and not (torch.isfinite(cls).all() and torch.isfinite(keys).all()):
        raise ValueError(f"{method}: inputs.vision_cls_last or inputs.vision_keys_last contains NaN or inf")
    dtype = torch.promote_types(keys.dtype, torch.float32)
    return cls.to(dtype), keys.to(dtype)


def check_text_rows(inputs: StageInputs, method: str) -> list[torch.Tensor]:
    """Per image, the valid instruction rows' attention over the visual tokens [R_b, N], float32."""
    batch, n_visual = inputs.hidden.shape[:2]
    rows, valid = inputs.text_rows, inputs.text_valid
    if rows is None or valid is None:
        raise ValueError(
            f"{method} needs the instruction rows' attention over the visual tokens (inputs.text_rows and "
            "inputs.text_valid), which exist only at a stage inside the language model; run it at a decoder "
            "layer, or use visionzip or prumerge before the language model"
        )
    if rows.ndim != 3 or rows.shape[0] != batch or rows.shape[2] != n_visual:
        raise ValueError(
            f"{method}: inputs.text_rows must be [B, R, N] with B, N = {(batch, n_visual)}, "
            f"got {tuple(rows.shape)}"
        )
    if valid.dtype != torch.bool or tuple(valid.shape) != tuple(rows.shape[:2]):
        raise ValueError(
            f"{method}: inputs.text_valid must be bool [B, R] = {tuple(rows.shape[:2])}, "
            f"got {valid.dtype} {tuple(valid.shape)}"
        )
    per_image = [image_rows[image_valid].float() for image_rows, image_valid in zip(rows, valid, strict=True)]
    for index, image_rows in enumerate(per_image):
        if image_rows.shape[0] == 0:
            raise ValueError(f"{method}: image {index} has no valid instruction row (inputs.text_valid)")
        if not torch.isfinite(image_rows).all():
            raise ValueError(f"{method}: inputs.text_rows of image {index} contains NaN or inf")
    return per_image


def check_attention(inputs: StageInputs, method: str) -> None:
    """``inputs.attention`` is present and covers the stage's images and visual tokens."""
    evidence = inputs.attention
    if evidence is None:
        raise ValueError(
            f"{method} needs the prior and posterior attention (inputs.attention), gathered at a decoder "
            "layer; run it at a layer inside the language model"
        )
    if tuple(evidence.posterior.shape) != tuple(inputs.hidden.shape[:2]):
        raise ValueError(
            f"{method}: inputs.attention is over {tuple(evidence.posterior.shape)} (images, tokens) but "
            f"inputs.hidden over {tuple(inputs.hidden.shape[:2])}"
        )


def same_count(counts: list[int], method: str, rule: str) -> None:
    """Adaptive counts must agree across the batch: a Selection has one K for every image."""
    if len(set(counts)) > 1:
        raise ValueError(
            f"{method}: {rule} gives a different number of tokens per image ({counts}) but a batch shares "
            f"one count; {SPLIT_HINT}"
        )
