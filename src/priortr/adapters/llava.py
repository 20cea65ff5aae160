"""LLaVA-1.5 (``LlavaForConditionalGeneration``): 576 ``<image>`` tokens on a 24x24 grid, separator
``\\n`` right after them (paper Appendix A.3)."""

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from torch import nn

from priortr.adapters.base import FamilyAdapter, VisionProbe, VisualItem


class LlavaAdapter(FamilyAdapter):
    name = "llava"
    model_types = ("llava",)
    separator_token = "the token after the <image> tokens ('\\n' in the LLaVA-1.5 template)"
    token_grids = True

    def item_grids(
        self, model_config, items: list[VisualItem], arguments: Mapping[str, Any]
    ) -> list[VisualItem]:
        """Every image on the vision tower's square patch grid, ``image_size // patch_size`` a side (24 x 24
        for LLaVA-1.5 at 336 px and 14 px patches), row-major as the tower emits them. An image of
        another token count ([CLS] kept: ``vision_feature_select_strategy='full'``) or a video is refused."""
        vision = model_config.vision_config
        side = vision.image_size // vision.patch_size
        out = []
        for item in items:
            if item.modality != "image" or item.size != side * side:
                raise ValueError(
                    f"a {item.modality} of {item.size} tokens does not fill the {side} x {side} patch grid "
                    f"of this {self.name} model's vision tower; a method that filters on the token grid "
                    "takes images of exactly that grid (vision_feature_select_strategy='default')"
                )
            out.append(replace(item, grid=(side, side)))
        return out

    def vision_probe(self, model: nn.Module) -> VisionProbe | None:
        """The self-attention of the CLIP layer whose output LLaVA projects (``vision_feature_layer``, the
        penultimate by default; VisionZip and VisPruner read its [CLS] attention), that of the last layer
        (PruMerge's) and the projector. None for towers without a class embedding (SigLIP) or
        multi-layer features."""
        config = model.config
        tower, projector = self.vision_modules(model)  # vision_tower (Video-LLaVA: image_tower)
        tower = getattr(tower, "vision_model", tower)  # CLIPVisionModel nests it in older releases
        feature_layer = config.vision_feature_layer
        embeddings = getattr(tower, "embeddings", None)
        if not hasattr(embeddings, "class_embedding") or not isinstance(feature_layer, int):
            return None
        layers = tower.encoder.layers
        index = feature_layer % (len(layers) + 1) - 1  # hidden_states[i] is the output of layer i - 1
        if index < 0:
            return None
        attention, last = layers[index].self_attn, layers[-1].self_attn
        first = 1 if config.vision_feature_select_strategy == "default" else 0
        return VisionProbe(
            query_projection=attention.q_proj,
            key_projection=attention.k_proj,
            heads=attention.num_heads,
            scaling=attention.scale,
            first_token=first,
            last_query_projection=last.q_proj,
            last_key_projection=last.k_proj,
            width=attention.embed_dim,
            projector=projector,
        )
