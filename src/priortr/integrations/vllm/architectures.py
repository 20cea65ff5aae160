"""The vLLM architecture names the plug-in answers for, without importing vLLM: those it serves, and
those of families ``priortr.apply`` prunes that it does not serve, with the reason.

The guard that keeps a ``priortr`` config from being served unpruned (``guard.py``) needs them where
registering the plug-in failed, so they live apart from ``registration.py``, which imports vLLM's
model modules.
"""

from __future__ import annotations

SERVED = (
    "LlavaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "InternVLForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "Glm4vForConditionalGeneration",
)
"""vLLM's names of the served families, in ``served_families.FAMILIES``' order."""
NOT_YET = "no plug-in class wraps its vLLM model yet"
UNSERVED = {
    "InternVLChatModel": (
        "InternVL's original layout, whose config and modeling code are the checkpoint's own remote code "
        "(trust_remote_code), which priortr.apply has no adapter for, so the plug-in's answers could not be "
        "checked against it; serve the Hugging Face format, InternVLForConditionalGeneration (the "
        "OpenGVLab/*-hf checkpoints)"
    ),
    "Gemma3ForConditionalGeneration": (
        "its sliding-window layers would count their window over the request's cache slots in vLLM (text + "
        "K per image after the cut) but over the prompt's positions in priortr.apply (text + N), so answers "
        "differ once a request's unpruned length passes the window; and vLLM's CPU attention has no "
        "bidirectional masks for the tokens of an image (stock vLLM on CPU attends causally within a Gemma 3 "
        "image, where transformers attends both ways)"
    ),
    "Idefics3ForConditionalGeneration": NOT_YET,
    "Llama4ForConditionalGeneration": NOT_YET,
    **dict.fromkeys(
        ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
        "its Gated DeltaNet layers keep a recurrent state per request in vLLM's Mamba state cache, which "
        "the plug-in's pruned prefill (layers 0..L run on the whole prompt outside vLLM's caches) does "
        "not write; and vLLM's CPU build runs those layers in bfloat16 only (vllm/model_executor/layers/"
        "mamba/ops/cpu/gdn_attention.py:158), where the plug-in's answers could not be checked exactly "
        "against priortr.apply",
    ),
}
"""vLLM architectures of families ``priortr.apply`` prunes and the plug-in does not serve, with the
reason: a config with ``priortr`` settings is refused at engine start instead of being served unpruned
(docs/serving.md)."""
ANY_OTHER = "it serves only " + ", ".join(SERVED)
"""The reason given for any other architecture vLLM knows (``registration.register_all``)."""
