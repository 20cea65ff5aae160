"""The one module that knows vLLM's decoder layers: the language model split at the scored layer, a
layer taken apart into the steps a pruned prefill runs separately, the batch facts read from vLLM's
attention metadata, and the one collective a pruned prefill adds under tensor parallelism.

vLLM's Llama, Mistral, Qwen2, Qwen3, Qwen3-VL and Qwen3-VL MoE decoder layers (LLaVA-1.5's, Mistral
3's, Qwen2/2.5-VL's, InternVL's, Qwen3-VL's and Qwen3-VL MoE's language models) are ``input_layernorm ->
self_attn (qkv_proj, rotary_emb, attn, o_proj) -> post_attention_layernorm -> mlp`` with a fused
residual, called as ``layer(positions, hidden, residual)``, and the language model ends in a norm that
takes the residual too; Qwen3's, Qwen3-VL's and Qwen3-VL MoE's attention applies an RMSNorm to each
head of q and k before RoPE (``q_norm`` / ``k_norm``, as vLLM's ``Qwen3Attention.forward`` and
``Qwen3MoeAttention.forward``). vLLM's Mistral layer is Llama's with two options the plug-in refuses:
Llama 4's position-dependent query scaling (``llama_4_scaling``, Ministral 3's text model) and a
time-conditioned norm (``ada_rms_norm_t_cond``). vLLM's GLM-4 layer (GLM-4.1V's language model) is
Llama's with "sandwich" norms, ``post_self_attn_layernorm`` on the attention output before the fused
residual norm and ``post_mlp_layernorm`` on the MLP output (``Glm4DecoderLayer.forward``); its RoPE
over part of each head is inside vLLM's ``rotary_emb``. A layer of another shape is refused when the
model loads, with its type named.

Qwen3-VL MoE's ``mlp`` is a dense MLP or vLLM's sparse MoE block (router, top-k experts, no shared
expert in Qwen3-VL MoE's config) through vLLM's fused-MoE layer. The block is a function of its rows
(each token is routed on its own), with two reads of vLLM's forward context: the layer by name
(``no_compile_layers``; ``fast_moe_cold_start`` would instead take the next name in call order, which a
pruned step breaks, so ``config_hooks`` turns it off) and ``is_padding``, the step's mask of padded
rows, which the routers on GPU apply to the first rows of whatever they are given; a pruned prompt
computed whole is not laid out as the step's rows, so it runs under ``unpadded_rows``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from vllm.distributed import get_pp_group
from vllm.distributed.communication_op import tensor_model_parallel_all_gather
from vllm.forward_context import get_forward_context
from vllm.sequence import IntermediateTensors

KNOWN_LAYERS = frozenset(
    {
        "Glm4DecoderLayer",
        "LlamaDecoderLayer",
        "MistralDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen3DecoderLayer",
        "Qwen3VLDecoderLayer",
        "Qwen3VLMoeDecoderLayer",
    }
)
QK_NORM_LAYERS = frozenset({"Qwen3DecoderLayer", "Qwen3VLDecoderLayer", "Qwen3VLMoeDecoderLayer"})
"""The known layers whose attention normalises each head of q and k before RoPE (``q_norm``, ``k_norm``)."""
SANDWICH_NORM_LAYERS = frozenset({"Glm4DecoderLayer"})
"""The known layers that also norm their attention's and their MLP's outputs (``post_self_attn_layernorm``,
``post_mlp_layernorm``)."""
READABLE_BACKENDS = frozenset({"CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "ROCM_ATTN"})
"""vLLM attention backends whose per-layer metadata carries ``query_start_loc`` and ``seq_lens`` as
tensors of the step's requests (read in vLLM 0.32 / 0.33; ``CPU_ATTN`` is the one run by the tests).
FlashInfer's metadata has no ``query_start_loc``; another backend is refused when the model loads."""
_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
_ATTENTION_PARTS = ("qkv_proj", "rotary_emb", "attn", "o_proj", "q_size", "kv_size", "num_heads")
_SANDWICH_NORMS = ("post_self_attn_layernorm", "post_mlp_layernorm")


class LayerParts:
    """One decoder layer's steps: the input norm, the q/k/v projections with RoPE, and everything
    after attention (output projection, norm, MLP). ``attention`` is vLLM's paged attention layer."""

    def __init__(self, layer: torch.nn.Module) -> None:
        name = type(layer).__name__
        missing = [part for part in _PARTS if not hasattr(layer, part)]
        attention = getattr(layer, "self_attn", None)
        missing += [part for part in _ATTENTION_PARTS if not hasattr(attention, part)]
        self.qk_norm = name in QK_NORM_LAYERS
        if self.qk_norm:
            missing += [part for part in ("q_norm", "k_norm") if not hasattr(attention, part)]
        self.sandwich_norms = name in SANDWICH_NORM_LAYERS
        if self.sandwich_norms:
            missing += [part for part in _SANDWICH_NORMS if not hasattr(layer, part)]
        if name not in KNOWN_LAYERS or missing or getattr(attention, "qk_norm", False):
            raise ValueError(
                f"priortr's vLLM plug-in runs {', '.join(sorted(KNOWN_LAYERS))} (q/k norms only on "
                f"{', '.join(sorted(QK_NORM_LAYERS))}); this model's decoder layer is "
                f"{name}{' lacking ' + ', '.join(missing) if missing else ''}"
            )
        check_options(layer)
        check_backend(attention.attn)
        self.layer = layer
        self.module = attention
        self.attention = attention.attn
        self.heads = attention.num_heads
        self.kv_heads = attention.num_kv_heads
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling

    def attention_input(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed attention input and the residual stream, as the layer forms them."""
        if residual is None:
            return self.layer.input_layernorm(hidden), hidden
        return self.layer.input_layernorm(hidden, residual)

    def project(
        self, normed: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H*d], k [T, Hkv*d] after RoPE at ``positions`` (and the per-head q/k norms before it,
        where the layer has them), and v [T, Hkv*d]."""
        module = self.module
        qkv, _ = module.qkv_proj(normed)
        q, k, v = qkv.split([module.q_size, module.kv_size, module.kv_size], dim=-1)
        if self.qk_norm:
            q = module.q_norm(q.view(*q.shape[:-1], -1, self.head_dim)).view(q.shape)
            k = module.k_norm(k.view(*k.shape[:-1], -1, self.head_dim)).view(k.shape)
        q, k = module.rotary_emb(positions, q, k)
        return q, k, v

    def output(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (hidden, residual) output from its attention output [T, H*d] (with the sandwich
        norms around the fused residual norm and after the MLP, where the layer has them)."""
        hidden, _ = self.module.o_proj(attended)
        if self.sandwich_norms:
            hidden = self.layer.post_self_attn_layernorm(hidden)
        hidden, residual = self.layer.post_attention_layernorm(hidden, residual)
        hidden = self.layer.mlp(hidden)
        if self.sandwich_norms:
            hidden = self.layer.post_mlp_layernorm(hidden)
        return hidden, residual

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """vLLM's attention layer on this step's rows [T, .]: it writes every row's key/value into
        its request's paged-cache slots and attends over the cache; the output is [T, H*d]."""
        return self.attention(q, k, v)

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention [T, H*d] of one whole sequence with itself (a prompt computed outside the
        paged cache), grouped-query heads shared as the layer shares them."""
        length = q.shape[0]
        query = q.view(length, self.heads, self.head_dim).transpose(0, 1)[None]  # [1, H, T, d]
        key = k.view(length, self.kv_heads, self.head_dim).transpose(0, 1)[None]  # [1, Hkv, T, d]
        value = v.view(length, self.kv_heads, self.head_dim).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=self.scaling, enable_gqa=True
        )
        return out[0].transpose(0, 1).reshape(length, self.heads * self.head_dim)

    def heads_view(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[T, heads*d] -> [1, heads, T, d]."""
        return x.view(x.shape[0], heads, self.head_dim).transpose(0, 1)[None]

    @staticmethod
    def every_head(rows: torch.Tensor) -> torch.Tensor:
        """This rank's attention rows [1, h, R, S] joined with every other tensor-parallel rank's, in
        head order: [1, H, R, S]. Under tensor parallelism each rank computes h = H / tp of the layer's
        heads (vLLM splits the q/k/v projections by head, rank r holding heads r*h .. r*h+h-1), while
        the method aggregates over all H (mean, or max: ``PruningConfig.heads``, which a sum reduced
        across ranks could not give), so every rank gathers the whole tensor and makes the same choice;
        with one rank it is ``rows`` itself."""
        return tensor_model_parallel_all_gather(rows.contiguous(), dim=1)


class TextModel:
    """A served model's language model split at the deepest scored layer ``layer``: ``scored`` (layers
    0..layer, taken apart) and the layers after it on this pipeline stage, run whole by ``finish`` with
    the final norm on the last stage; ``layers`` holds every layer of the first stage taken apart (a
    stage that ranks by the next layer's attention projects with it). Under pipeline parallelism the
    scored layers must be on the first stage (``config_hooks`` refuses the rest when the engine starts);
    a later stage has none. Every layer of the stage is checked when the model loads."""

    def __init__(self, model: torch.nn.Module, layer: int) -> None:
        text_model = getattr(getattr(model, "language_model", None), "model", None)
        if not hasattr(text_model, "layers") or not hasattr(text_model, "norm"):
            raise ValueError(
                f"priortr's vLLM plug-in runs a language model at .language_model.model with .layers and "
                f".norm; {type(model).__name__} has none"
            )
        layers = list(text_model.layers)
        start = getattr(text_model, "start_layer", 0)
        end = getattr(text_model, "end_layer", len(layers))
        if start == 0 and end <= layer:
            raise ValueError(
                f"priortr's vLLM plug-in scores layer {layer} on the first pipeline stage, which holds "
                f"layers 0..{end - 1}"
            )
        checked = [LayerParts(each) for each in layers[start:end]]  # refuses a layer shape it does not know
        self.layers = checked if start == 0 else []
        self.scored = self.layers[: layer + 1]
        self._rest = layers[max(start, layer + 1) : end]
        self._norm = text_model.norm

    def finish(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor | IntermediateTensors:
        """The stage's layers after the scored one on (hidden, residual) [T, D], then the final norm
        on the last pipeline stage; a stage before it hands (hidden, residual) on."""
        for layer in self._rest:
            hidden, residual = layer(positions, hidden, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = self._norm(hidden, residual)
        return hidden


def check_options(layer: torch.nn.Module) -> None:
    """Refuse, when the model loads, a layer option that the pruned prefill does not run as
    ``priortr.apply`` does: a sliding attention window (layers 0..L attend causally over the whole
    prompt, and vLLM counts a later layer's window over a pruned request's cache slots, where ``apply``
    counts prompt positions: docs/serving.md, Gemma 3), and Mistral's Llama 4 query scaling by position
    (Ministral 3) and time-conditioned norm after attention."""
    window = getattr(getattr(layer.self_attn, "attn", None), "sliding_window", None)
    if window is not None:
        raise ValueError(
            f"priortr's vLLM plug-in does not serve sliding-window attention (this model's layers attend "
            f"within {window} tokens): its pruned prefill attends over the whole prompt, and vLLM counts a "
            "window over a pruned request's cache slots where priortr.apply counts prompt positions; serve "
            "the model without priortr settings"
        )
    if getattr(layer.self_attn, "do_llama_4_scaling", False):
        raise ValueError(
            "priortr's vLLM plug-in does not run Llama 4's position-dependent query scaling "
            "(llama_4_scaling in the text config, as Ministral 3's); serve the model without priortr"
        )
    if getattr(layer, "ada_rms_norm_t_cond", None) is not None:
        raise ValueError(
            "priortr's vLLM plug-in does not run a time-conditioned norm (ada_rms_norm_t_cond in the text "
            "config); serve the model without priortr"
        )


def check_backend(attention: torch.nn.Module) -> None:
    """Refuse, when the model loads, an attention backend whose metadata ``request_bounds`` cannot read."""
    name = attention.get_attn_backend().get_name()
    if name not in READABLE_BACKENDS:
        raise ValueError(
            f"priortr's vLLM plug-in reads each step's request layout (query_start_loc, seq_lens) from "
            f"the attention metadata, which the {name} backend does not carry; pass --attention-backend "
            f"with one of {', '.join(sorted(READABLE_BACKENDS))} (LLM(attention_backend=...))"
        )


def request_bounds(layer: LayerParts) -> tuple[list[int], list[int]]:
    """Host copies of this step's request boundaries (query start locations, R + 1 of them) and each
    request's tokens in the cache after the step (sequence lengths), from vLLM's attention metadata:
    the one place the plug-in reads that metadata (``check_backend`` refused the backends without it
    when the model loaded)."""
    metadata: Any = get_forward_context().attn_metadata
    entry = metadata.get(layer.attention.layer_name) if isinstance(metadata, dict) else None
    if entry is None or not hasattr(entry, "query_start_loc") or not hasattr(entry, "seq_lens"):
        raise RuntimeError(
            "priortr's vLLM plug-in reads query_start_loc and seq_lens from the attention metadata; "
            f"this attention backend gives {type(entry).__name__}"
        )
    return entry.query_start_loc.tolist(), entry.seq_lens.tolist()


@contextmanager
def unpadded_rows() -> Iterator[None]:
    """Run the enclosed layers on rows that are all real tokens but not laid out as the step's rows (a
    pruned prompt computed whole, N visual tokens where the step holds K): vLLM's forward context marks
    the step's padded rows (``is_padding``, set every step by the model runner, True on the rows padded
    for CUDA graphs), and vLLM's GPU fused-MoE routers skip the rows it marks among the first rows of
    their input, which here are other tokens, or read past its end when the prompt is longer than the
    step (``VLLM_MOE_SKIP_PADDING``, on by default in vLLM 0.32 / 0.33; the CPU build's router ignores
    it)."""
    context = get_forward_context()
    padding, context.is_padding = context.is_padding, None
    try:
        yield
    finally:
        context.is_padding = padding
