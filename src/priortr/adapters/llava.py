"""LLaVA-1.5 (``LlavaForConditionalGeneration``): 576 ``<image>`` tokens on a 24x24 grid, separator
``\\n`` right after them (paper Appendix A.3)."""

from torch import nn

from priortr.adapters.base import FamilyAdapter, VisionProbe


class LlavaAdapter(FamilyAdapter):
    name = "llava"
    model_types = ("llava",)
    separator_token = "the token after the <image> tokens ('\\n' in the LLaVA-1.5 template)"

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

    def visual_grid(self, config, inputs: dict, row: int) -> tuple[int, int]:
        """A square grid of CLIP patches, side ``image_size // patch_size`` (24 x 24 for LLaVA-1.5 at 336 px);
        ``vision_feature_select_strategy='full'`` would add the CLS token and has no grid."""
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        n_visual = getattr(config, "image_seq_length", side * side)
        if n_visual != side * side:
            raise ValueError(
                f"{n_visual} visual tokens per image are not the {side}x{side} patch grid (a CLS token is "
                "kept with vision_feature_select_strategy='full'); cannot map tokens to image regions"
            )
        return side, side

    def image_view(self, image, processor):
        """The crop of ``image`` that CLIP preprocessing keeps, at the original's resolution.

        The processor pads to a square first if ``do_pad``, resizes the shortest edge to ``size`` (or to
        ``height`` x ``width``) and centre-crops ``crop_size``; only the pad and the crop change what the
        patch grid spans.
        """
        ip = getattr(processor, "image_processor", processor)
        if getattr(ip, "do_pad", False):
            image = self._pad_to_square(image, getattr(ip, "image_mean", None))
        if not getattr(ip, "do_center_crop", False):
            return image
        width, height = image.size
        new_h, new_w = self._resized_size(ip, height, width)
        crop_h, crop_w = min(ip.crop_size.get("height"), new_h), min(ip.crop_size.get("width"), new_w)
        top, left = (new_h - crop_h) // 2, (new_w - crop_w) // 2
        sx, sy = width / new_w, height / new_h
        box = (left * sx, top * sy, (left + crop_w) * sx, (top + crop_h) * sy)
        return image.crop(tuple(round(v) for v in box))

    @staticmethod
    def _resized_size(ip, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the processor's resize, as transformers' ``get_resize_output_image_size``."""
        size = ip.size if getattr(ip, "do_resize", True) else {}
        if size.get("height") and size.get("width"):
            return size.get("height"), size.get("width")
        short_side = size.get("shortest_edge")
        if not short_side:
            return height, width
        if width <= height:
            return int(short_side * height / width), short_side
        return short_side, int(short_side * width / height)

    @staticmethod
    def _pad_to_square(image, mean):
        """``image`` centred on a square of its longest side, filled with the processor's mean colour."""
        from PIL import Image

        width, height = image.size
        side = max(width, height)
        if width == height:
            return image
        fill = tuple(int(m * 255) for m in mean) if mean is not None else 0
        square = Image.new(image.mode, (side, side), fill if image.mode == "RGB" else 0)
        square.paste(image, ((side - width) // 2, (side - height) // 2))
        return square
