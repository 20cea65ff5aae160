"""scripts/vllm_names.py, which CI runs on the newest vLLM wheel's source, on the installed vLLM:
every name the plug-in relies on is found, and names vLLM lacks are reported (negative controls)."""

from __future__ import annotations

from pathlib import Path

import vllm

from scripts.vllm_names import NAMES, Name, missing

SOURCE = Path(vllm.__file__).parent.parent


def test_installed_vllm_has_every_name():
    assert missing(SOURCE) == []
    assert len(NAMES) > 60


def test_lacking_names_and_parameters_are_reported():
    processor = "vllm.model_executor.models.llava"
    wrong = [
        Name("vllm.multimodal", "MULTIMODAL_REGISTRIES"),
        Name(processor, "LlavaMultiModalProcessor.apply", ("inputs", "timing_context")),
        Name(processor, "LlavaForConditionalGeneration.embed_input_ids", ("input_ids", "is_multimodal_mask")),
        Name("vllm.config.vllm", "VllmConfig.lora_configuration"),
        Name("vllm.v1.request", "Request.skip_reading_prefix_caches"),
        Name(
            "vllm.v1.request",
            "Request.prefix_cache_hit_limits",
            either=("Request.skip_reading_prefix_caches",),
        ),
    ]
    assert missing(SOURCE, wrong) == [
        "vllm.multimodal.MULTIMODAL_REGISTRIES: not found",
        f"{processor}.LlavaMultiModalProcessor.apply: takes no timing_context",
        f"{processor}.LlavaForConditionalGeneration.embed_input_ids: takes no is_multimodal_mask",
        "vllm.config.vllm.VllmConfig.lora_configuration: not found",
        "vllm.v1.request.Request.skip_reading_prefix_caches: not found",
        "vllm.v1.request.Request.prefix_cache_hit_limits: not found or "
        "vllm.v1.request.Request.skip_reading_prefix_caches: not found",
    ]


def test_inherited_and_reexported_names_resolve():
    """apply is BaseMultiModalProcessor's, reached through LlavaMultiModalProcessor's bases;
    ModelRegistry is re-exported by vllm/__init__.py; AsyncScheduler's add_request is Scheduler's,
    and a request's skip_reading_prefix_cache is assigned in Request.__init__ (vLLM 0.32/0.33: it stands
    in for 0.34's prefix_cache_hit_limit, which this release lacks)."""
    inherited = [Name("vllm.model_executor.models.llava", "LlavaMultiModalProcessor.apply", ("inputs",))]
    assert missing(SOURCE, inherited) == []
    assert missing(SOURCE, [Name("vllm", "ModelRegistry")]) == []
    scheduler = Name("vllm.v1.core.sched.async_scheduler", "AsyncScheduler.add_request", ("request",))
    assert missing(SOURCE, [scheduler, Name("vllm.v1.request", "Request.skip_reading_prefix_cache")]) == []
    bound = Name("vllm.v1.request", "Request.prefix_cache_hit_limit")
    assert missing(SOURCE, [bound]) == ["vllm.v1.request.Request.prefix_cache_hit_limit: not found"]
    either = Name(bound.module, bound.name, either=("Request.skip_reading_prefix_cache",))
    assert missing(SOURCE, [either]) == []
