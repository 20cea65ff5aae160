"""Model inputs whose names differ between transformers releases."""

from __future__ import annotations

import inspect
from typing import Any


def rename_image_argument(model: Any, inputs: dict) -> dict:
    """``inputs`` with ``pixel_values`` renamed ``pixel_values_images`` for models whose forward still
    calls it that (Video-LLaVA before transformers 5.23)."""
    parameters = inspect.signature(model.forward).parameters
    if "pixel_values" in inputs and "pixel_values" not in parameters and "pixel_values_images" in parameters:
        inputs = dict(inputs)
        inputs["pixel_values_images"] = inputs.pop("pixel_values")
    return inputs
