"""LLaVA-1.5 (``LlavaForConditionalGeneration``): 576 ``<image>`` tokens on a 24x24 grid, separator
``\\n`` right after them (paper Appendix A.3)."""

from priortr.adapters.base import FamilyAdapter


class LlavaAdapter(FamilyAdapter):
    name = "llava"
    model_types = ("llava",)
    separator_token = "the token after the <image> tokens ('\\n' in the LLaVA-1.5 template)"
