"""Check that every vLLM name the priortr plug-in imports, subclasses, overrides or reads exists, with
the parameters it relies on, in a vLLM source tree (an unpacked wheel: read, never imported).

    python scripts/vllm_names.py SRC     # SRC holds vllm/ (e.g. a vllm-*.whl unzipped)

CI runs it on the newest vLLM release in the plug-in's supported range (scripts/check-vllm-gpu.sh);
tests/vllm/test_names.py runs it on the installed vLLM, with a negative control. Names are resolved
through ``from ... import`` re-exports and class bases inside vLLM's source, so an inherited method
counts; a parameter list is checked by name (what the plug-in passes or overrides).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

MODELS = "vllm.model_executor.models"
SERVED = [
    ("llava", "LlavaForConditionalGeneration", "LlavaMultiModalProcessor", "LlavaProcessingInfo", "Llava"),
    (
        "qwen2_vl",
        "Qwen2VLForConditionalGeneration",
        "Qwen2VLMultiModalProcessor",
        "Qwen2VLProcessingInfo",
        "Qwen2VL",
    ),
    (
        "qwen2_5_vl",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2_5_VLMultiModalProcessor",
        "Qwen2_5_VLProcessingInfo",
        "Qwen2_5_VL",
    ),
    (
        "qwen3_vl",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMultiModalProcessor",
        "Qwen3VLProcessingInfo",
        "Qwen3VL",
    ),
    (
        "qwen3_vl_moe",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3VLMultiModalProcessor",
        "Qwen3VLMoeProcessingInfo",
        "Qwen3VL",
    ),
    (
        "interns1",
        "InternS1ForConditionalGeneration",
        "InternS1MultiModalProcessor",
        "InternS1ProcessingInfo",
        "InternS1",
    ),
    (
        "llava_onevision",
        "LlavaOnevisionForConditionalGeneration",
        "LlavaOnevisionMultiModalProcessor",
        "LlavaOnevisionProcessingInfo",
        "LlavaOnevision",
    ),
    (
        "llava_next",
        "LlavaNextForConditionalGeneration",
        "LlavaNextMultiModalProcessor",
        "LlavaNextProcessingInfo",
        "Llava",
    ),
    (
        "mistral3",
        "Mistral3ForConditionalGeneration",
        "Mistral3MultiModalProcessor",
        "Mistral3ProcessingInfo",
        "Mistral3",
    ),
    (
        "glm4_1v",
        "Glm4vForConditionalGeneration",
        "Glm4vMultiModalProcessor",
        "Glm4vProcessingInfo",
        "Glm4v",
    ),
]
LINEAR_ROPE = ("llava", "interns1", "llava_next", "llava_onevision", "mistral3")
"""Served modules of 1-D RoPE models, which have no ``get_mrope_input_positions`` of their own."""


@dataclass(frozen=True)
class Name:
    """``module``'s ``name`` (``Class.member`` for a member), with the parameters it must take; where
    ``either`` names others of the same module, any one of them found will do (a name a release
    replaced, which the plug-in reads whichever the installed release has)."""

    module: str
    name: str
    parameters: tuple[str, ...] = ()
    either: tuple[str, ...] = ()


def _served() -> list[Name]:
    names = []
    for module, model, processor, info, prefix in SERVED:
        path = f"{MODELS}.{module}"
        names += [
            Name(path, f"{model}.__init__", ("vllm_config", "prefix")),
            Name(path, f"{model}.embed_multimodal"),
            Name(path, f"{model}.embed_input_ids", ("input_ids", "multimodal_embeddings", "is_multimodal")),
            Name(
                path, f"{model}.forward", ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")
            ),
            Name(path, f"{processor}._apply_hf_processor_main", ("mm_items", "hf_kwargs")),
            Name(path, f"{processor}.apply", ("inputs", "timing_ctx")),
            Name(path, f"{processor}.get_dummy_inputs"),
            Name(path, info),
            Name(path, f"{prefix}DummyInputsBuilder"),
        ]
        if module not in LINEAR_ROPE:
            names.append(Name(path, f"{model}.get_mrope_input_positions", ("input_tokens", "mm_features")))
    return names


NAMES = [
    Name("vllm", "ModelRegistry"),
    Name(f"{MODELS}.registry", "_ModelRegistry.register_model", ("model_arch", "model_cls")),
    Name("vllm.multimodal", "MULTIMODAL_REGISTRY"),
    Name(
        "vllm.multimodal.registry",
        "MultiModalRegistry.register_processor",
        ("processor", "info", "dummy_inputs"),
    ),
    Name("vllm.multimodal.inputs", "PlaceholderRange.offset"),
    Name("vllm.multimodal.inputs", "PlaceholderRange.length"),
    Name("vllm.multimodal.inputs", "PlaceholderRange.is_embed"),
    Name("vllm.multimodal.inputs", "MultiModalFieldElem.data"),
    Name("vllm.multimodal.inputs", "MultiModalFieldElem.field"),
    Name("vllm.multimodal.inputs", "MultiModalBatchedField"),
    Name("vllm.multimodal.inputs", "BaseMultiModalField.keep_on_cpu"),
    Name("vllm.multimodal.inputs", "MultiModalKwargsItem"),
    Name("vllm.multimodal.processing.inputs", "ProcessorInputs.hf_processor_mm_kwargs"),
    Name("vllm.multimodal.processing.inputs", "ProcessorInputs.mm_uuid_items"),
    Name("vllm.multimodal.processing.inputs", "ProcessorInputs.cache"),
    Name("vllm.multimodal.processing.inputs", "ProcessorInputs.media_io_kwargs"),
    Name("vllm.config.multimodal", "MultiModalConfig.mm_processor_kwargs"),
    Name("vllm.config.multimodal", "MultiModalConfig.media_io_kwargs"),
    Name(f"{MODELS}.llava", "_build_llava_or_pixtral_hf_processor"),
    Name(f"{MODELS}.llava", "_build_llava_or_pixtral_hf_info"),
    Name(f"{MODELS}.vision", "get_num_selected_vision_tokens"),
    Name(f"{MODELS}.vision", "get_vision_encoder_info"),
    Name(f"{MODELS}.config", "MODELS_CONFIG_MAP"),
    Name(f"{MODELS}.config", "VerifyAndUpdateConfig.verify_and_update_model_config", ("model_config",)),
    Name(f"{MODELS}.config", "VerifyAndUpdateConfig.verify_and_update_config", ("vllm_config",)),
    Name("vllm.forward_context", "get_forward_context"),
    Name("vllm.model_executor.layers.attention.attention", "Attention.get_attn_backend"),
    Name("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadata.query_start_loc"),
    Name("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadata.seq_lens"),
    Name("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadata.query_start_loc"),
    Name("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadata.seq_lens"),
    Name("vllm.v1.attention.backends.triton_attn", "TritonAttentionMetadata.query_start_loc"),
    Name("vllm.v1.attention.backends.triton_attn", "TritonAttentionMetadata.seq_lens"),
    Name("vllm.config.scheduler", "SchedulerConfig.enable_chunked_prefill"),
    Name("vllm.config.scheduler", "SchedulerConfig.scheduler_cls"),
    Name("vllm.config.scheduler", "SchedulerConfig.async_scheduling"),
    Name("vllm.config.scheduler", "SchedulerConfig.max_num_batched_tokens"),
    Name("vllm.config.scheduler", "SchedulerConfig.long_prefill_token_threshold"),
    Name("vllm.config.scheduler", "SchedulerConfig.max_num_scheduled_tokens"),
    Name("vllm.v1.core.sched.scheduler", "Scheduler.__init__", ("vllm_config",)),
    Name("vllm.v1.core.sched.scheduler", "Scheduler.add_request", ("request",)),
    Name(
        "vllm.v1.core.sched.scheduler",
        "Scheduler._try_schedule_encoder_inputs",
        ("request", "num_computed_tokens", "num_new_tokens", "encoder_compute_budget"),
    ),
    Name("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
    Name("vllm.v1.core.sched.scheduler", "Scheduler.max_num_scheduled_tokens"),
    Name("vllm.v1.core.sched.scheduler", "Scheduler.max_num_encoder_input_tokens"),
    Name("vllm.v1.core.sched.scheduler", "Scheduler.encoder_cache_manager"),
    Name("vllm.v1.core.encoder_cache_manager", "EncoderCacheManager.__init__", ("cache_size",)),
    Name("vllm.v1.core.encoder_cache_manager", "EncoderCacheManager.reset"),
    Name(
        "vllm.v1.core.encoder_cache_manager",
        "EncoderCacheManager.can_allocate",
        ("request", "input_id", "encoder_compute_budget", "num_embeds_to_schedule"),
    ),
    Name("vllm.v1.core.encoder_cache_manager", "EncoderCacheManager.allocate", ("request", "input_id")),
    Name(
        "vllm.v1.core.encoder_cache_manager",
        "EncoderCacheManager.get_cached_num_encoder_embeds",
        ("request", "input_id"),
    ),
    Name("vllm.v1.core.encoder_cache_manager", "EncoderCacheManager.get_freed_mm_hashes"),
    Name("vllm.v1.request", "Request.get_num_encoder_embeds", ("input_id",)),
    Name("vllm.v1.core.encoder_cache_manager", "EncoderCacheManager.cache_size"),
    Name("vllm.v1.core.encoder_cache_manager", "EncoderCacheManager.cached"),
    Name("vllm.v1.core.encoder_cache_manager", "EncoderCacheManager.freed"),
    Name("vllm.v1.core.encoder_cache_manager", "EncoderCacheManager.num_embeds_by_hash"),
    Name("vllm.v1.core.encoder_cache_manager", "EncoderCacheManager.num_free_slots"),
    Name("vllm.v1.core.encoder_cache_manager", "EncoderCacheManager.num_freeable_slots"),
    Name("vllm.v1.core.sched.async_scheduler", "AsyncScheduler"),
    Name("vllm.v1.core.kv_cache_manager", "KVCacheManager.prefix_cache_lookup_enabled", ("request",)),
    Name("vllm.v1.request", "Request.prefix_cache_hit_limit", either=("Request.skip_reading_prefix_cache",)),
    Name("vllm.v1.request", "Request.resumable"),
    Name("vllm.v1.request", "Request.request_id"),
    Name("vllm.v1.core.sched.scheduler", "Scheduler.encoder_cache_mismatch_reqs"),
    Name("vllm.v1.request", "Request.num_prompt_tokens"),
    Name("vllm.v1.request", "Request.max_tokens"),
    Name("vllm.v1.core.sched.scheduler", "Scheduler.vllm_config"),
    Name("vllm.config.model", "ModelConfig.max_model_len"),
    Name("vllm.config.model", "ModelConfig.hf_text_config"),
    Name("vllm.v1.request", "Request.mm_features"),
    Name("vllm.multimodal.inputs", "MultiModalFeatureSpec.data"),
    Name("vllm.multimodal.inputs", "MultiModalFeatureSpec.modality"),
    Name("vllm.multimodal.inputs", "MultiModalFeatureSpec.mm_position"),
    Name("vllm.multimodal.inputs", "MultiModalFeatureSpec.identifier"),
    Name("vllm.multimodal.inputs", "PlaceholderRange.get_num_embeds"),
    Name("vllm.config.cache", "CacheConfig.enable_prefix_caching"),
    Name("vllm.config.cache", "CacheConfig.kv_offloading_size"),
    Name("vllm.config.model", "ModelConfig.enforce_eager"),
    Name("vllm.config.compilation", "CompilationConfig.mode"),
    Name("vllm.config.compilation", "CompilationConfig.cudagraph_mode"),
    Name("vllm.config.compilation", "CompilationMode.STOCK_TORCH_COMPILE"),
    Name("vllm.config.compilation", "CUDAGraphMode.NONE"),
    Name("vllm.config.compilation", "CUDAGraphMode.FULL"),
    Name("vllm.config.compilation", "CUDAGraphMode.FULL_DECODE_ONLY"),
    Name("vllm.config.compilation", "CUDAGraphMode.mixed_mode"),
    Name("vllm.envs", "VLLM_USE_BREAKABLE_CUDAGRAPH"),
    Name("vllm.envs", "VLLM_BATCH_INVARIANT"),
    Name("vllm.config.parallel", "ParallelConfig.prefill_context_parallel_size"),
    Name("vllm.config.parallel", "ParallelConfig.decode_context_parallel_size"),
    Name("vllm.config.parallel", "ParallelConfig.use_ubatching"),
    Name("vllm.distributed.communication_op", "tensor_model_parallel_all_gather", ("input_", "dim")),
    Name("vllm.config.parallel", "ParallelConfig.pipeline_parallel_size"),
    Name("vllm.config.vllm", "VllmConfig.speculative_config"),
    Name("vllm.config.vllm", "VllmConfig.kv_transfer_config"),
    Name("vllm.config.vllm", "VllmConfig.ec_transfer_config"),
    Name("vllm.config.vllm", "VllmConfig.lora_config"),
    Name("vllm.config.compilation", "CompilationConfig.cudagraph_mm_encoder"),
    Name("vllm.config.multimodal", "MultiModalConfig.video_pruning_rate"),
    Name("vllm.config.multimodal", "MultiModalConfig.mm_processor_cache_type"),
    Name(f"{MODELS}.qwen3_vl", "Qwen3VLDecoderLayer"),
    Name(f"{MODELS}.qwen3_vl_moe", "Qwen3VLMoeDecoderLayer"),
    Name("vllm.forward_context", "ForwardContext.is_padding"),
    Name("vllm.config.compilation", "CompilationConfig.fast_moe_cold_start"),
    Name("vllm.config.parallel", "ParallelConfig.tensor_parallel_size"),
    Name("vllm.config.parallel", "ParallelConfig.data_parallel_size"),
    Name("vllm.config.parallel", "ParallelConfig.enable_expert_parallel"),
    Name("vllm.config.parallel", "ParallelConfig.enable_eplb"),
    Name("vllm.config.vllm", "VllmConfig.aux_output_config"),
    Name("vllm.config.aux_output", "AuxOutputConfig.enable_return_routed_experts"),
    Name(f"{MODELS}.interns1", "InternS1ForConditionalGeneration.num_image_token"),
    Name(f"{MODELS}.llava_onevision", "LlavaOnevisionForConditionalGeneration.config"),
    Name(f"{MODELS}.llava_next", "LlavaNextForConditionalGeneration.config"),
    Name(f"{MODELS}.mistral3", "Mistral3ForConditionalGeneration.config"),
    Name(f"{MODELS}.mistral", "MistralDecoderLayer.ada_rms_norm_t_cond"),
    Name(f"{MODELS}.mistral", "MistralAttention.do_llama_4_scaling"),
    Name(f"{MODELS}.glm4", "Glm4DecoderLayer.post_self_attn_layernorm"),
    Name(f"{MODELS}.glm4", "Glm4DecoderLayer.post_mlp_layernorm"),
    Name("vllm.multimodal.inputs", "MultiModalFeatureSpec.mm_position"),
    Name("vllm.multimodal.inputs", "MultiModalFeatureSpec.identifier"),
    Name(
        f"{MODELS}.qwen3_vl", "Qwen3VLForConditionalGeneration._get_deepstack_input_embeds", ("num_tokens",)
    ),
    Name(
        f"{MODELS}.qwen3_vl", "Qwen3VLForConditionalGeneration._clear_deepstack_input_embeds", ("num_tokens",)
    ),
    *_served(),
]


class Source:
    """Module-level definitions of a vLLM source tree, read with ``ast``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            base = self.root.joinpath(*module.split("."))
            path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            self._trees[module] = ast.parse(path.read_text()) if path.is_file() else None
        return self._trees[module]

    def find(self, module: str, name: str, seen: frozenset = frozenset()) -> tuple[str, ast.AST] | None:
        """(module, node) defining ``name`` at ``module``'s top level, following ``from`` imports."""
        tree = self.tree(module)
        if tree is None or (module, name) in seen:
            return None
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
                return module, node
            if isinstance(node, ast.Assign) and any(_is(t, name) for t in node.targets):
                return module, node
            if isinstance(node, ast.AnnAssign) and _is(node.target, name):
                return module, node
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, node, self._is_package(module))
                        return self.find(source, alias.name, seen | {(module, name)})
        return None

    def member(self, module: str, cls: ast.ClassDef, name: str) -> ast.AST | None:
        """The method or field ``name`` of ``cls`` (defined in ``module``) or of a base inside vLLM;
        an attribute ``__init__`` assigns (``self.name = ...``) counts as a field."""
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
            if isinstance(node, ast.AnnAssign) and _is(node.target, name):
                return node
            if isinstance(node, ast.Assign) and any(_is(t, name) for t in node.targets):
                return node
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                for statement in ast.walk(node):
                    targets = [statement.target] if isinstance(statement, ast.AnnAssign) else []
                    targets += statement.targets if isinstance(statement, ast.Assign) else []
                    if any(_is_self(target, name) for target in targets):
                        return statement
        for base in cls.bases:
            base_name = (
                base.value.id
                if isinstance(base, ast.Subscript) and isinstance(base.value, ast.Name)
                else None
            )
            base_name = base.id if isinstance(base, ast.Name) else base_name
            found = self.find(module, base_name) if base_name else None
            if found and isinstance(found[1], ast.ClassDef):
                member = self.member(found[0], found[1], name)
                if member is not None:
                    return member
        return None

    def _is_package(self, module: str) -> bool:
        return self.root.joinpath(*module.split("."), "__init__.py").is_file()


def _top_level(tree: ast.Module) -> list[ast.AST]:
    """Statements at module level, those inside ``if`` / ``try`` blocks included (TYPE_CHECKING)."""
    out: list[ast.AST] = []
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.If | ast.Try):
            pending += node.body + node.orelse + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                pending += handler.body
        else:
            out.append(node)
    return out


def _is(target: ast.AST, name: str) -> bool:
    return isinstance(target, ast.Name) and target.id == name


def _is_self(target: ast.AST, name: str) -> bool:
    return isinstance(target, ast.Attribute) and _is(target.value, "self") and target.attr == name


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _parameters(node: ast.AST) -> set[str] | None:
    """Parameter names of a function; None for a function taking ``**kwargs`` (takes any keyword)."""
    if not isinstance(node, ast.FunctionDef):
        return set()
    args = node.args
    if args.kwarg is not None:
        return None
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}


def missing(root: Path, names: list[Name] = NAMES) -> list[str]:
    """One line per name in ``names`` that the vLLM source under ``root`` lacks or takes otherwise."""
    source = Source(root)
    problems = []
    for entry in names:
        alternatives = (entry.name, *entry.either)
        found = [problem(source, entry.module, name, entry.parameters) for name in alternatives]
        if all(found):
            problems.append(" or ".join(found))
    return problems


def problem(source: Source, module: str, name: str, parameters: tuple[str, ...]) -> str | None:
    """What is wrong with ``module``'s ``name`` in ``source``: None where it is found as the plug-in
    needs it."""
    owner, _, member = name.partition(".")
    found = source.find(module, owner)
    label = f"{module}.{name}"
    if found is None:
        return f"{label}: not found"
    node = found[1]
    if member:
        if not isinstance(node, ast.ClassDef):
            return f"{label}: {owner} is not a class"
        node = source.member(found[0], node, member)
        if node is None:
            return f"{label}: not found"
    taken = _parameters(node) if parameters else None
    lacking = [] if taken is None else [p for p in parameters if p not in taken]
    return f"{label}: takes no {', '.join(lacking)}" if lacking else None


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not Path(argv[1], "vllm").is_dir():
        print(f"usage: python {argv[0]} SRC  (SRC/vllm: vLLM's source, e.g. an unzipped wheel)")
        return 2
    problems = missing(Path(argv[1]))
    for line in problems:
        print(line)
    print(f"{len(NAMES) - len(problems)} of {len(NAMES)} vLLM names the plug-in relies on found")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
