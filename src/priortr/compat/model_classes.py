"""The image-text model classes the installed transformers ships, read from its auto mappings.

``AutoModelForImageTextToText`` resolves a config's ``model_type`` to its class through
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``; releases before 5 also had
``MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES`` (``AutoModelForVision2Seq``), read too where it exists. A
release that names neither is refused: priortr cannot say which of its models take images.
"""

from __future__ import annotations

from transformers.models.auto import modeling_auto

from priortr.compat.release import refuse

MAPPINGS = ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES")
"""The auto mappings (``model_type`` -> class name) of the models that take images and text."""


def image_text_classes() -> dict[str, str]:
    """Every image-text model of the installed release: ``model_type`` -> the class its auto model
    builds, sorted by model type (a model type in several mappings keeps its first mapping's class)."""
    found = [getattr(modeling_auto, name) for name in MAPPINGS if hasattr(modeling_auto, name)]
    if not found:
        refuse(f"transformers' auto models name none of the image-text mappings {', '.join(MAPPINGS)}")
    classes: dict[str, str] = {}
    for mapping in found:
        for model_type, names in mapping.items():
            classes.setdefault(model_type, names if isinstance(names, str) else names[0])
    return dict(sorted(classes.items()))
