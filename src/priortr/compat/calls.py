"""How the multimodal model and its decoder layers take their arguments, resolved from their signatures.

The engine reads and rewrites the arguments of two kinds of calls: the multimodal model's (prompt ids,
masks, position ids, images, the KV cache) in its permanent pre-hook, and a decoder layer's (hidden
states, RoPE, mask, cache) between layers of a pruned prefill. transformers names these arguments, and
renames them (5.24: ``past_key_values`` -> ``cache``, the old name kept as a deprecated alias until 5.40),
so the names are looked up once, when pruning is attached, from the installed release's signatures
(``resolve``); the engine only uses the views below. A signature that matches no known contract is
refused there (``release.refuse``).

The views are rewritten through methods (``set_hidden``, ``set_attention_mask``, ...), never through
property setters: inside a compiled graph, torch 2.11's dynamo drops what a property setter writes,
silently (2.13 does not), and the hooks that rewrite these calls run in the graphs.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from priortr.compat.release import check_release, refuse
from priortr.tensors.gathers import gather_sequence

CACHE_NAMES = ("cache", "past_key_values")
"""Names a forward has taken its KV cache by, newest first. A release that renames it again needs one
more entry here."""

RAW_PIXEL_ARGUMENTS = ("pixel_values", "pixel_values_images", "pixel_values_videos")
"""Model arguments that carry raw images or video (``pixel_values_images``: Video-LLaVA before 5.23)."""

ENCODED_INPUTS = "mm_encoder_outputs"
"""Where ``generate()`` passes images it encoded before the prefill, by modality."""

TOKEN_ALIGNED = ("position_ids", "mm_token_type_ids", "token_type_ids")
"""Model arguments with one entry per input token (last dimension), sliced with the tokens."""

LAYER_INPUTS = ("hidden_states", "attention_mask", "position_embeddings")
"""What every supported decoder layer takes besides its cache; ``position_ids`` is optional."""

LAYER_TOKEN_INPUTS = ("per_layer_input",)
"""Decoder-layer arguments with one entry per token of the sequence the layer runs on (dimension 1), cut
with the hidden states: Gemma 4's per-layer inputs (E2B/E4B), one slice per layer of a tensor its text
model makes before layer 0."""

SHARED_STATES = "shared_kv_states"
"""The decoder-layer argument through which layers pass keys and values to later layers of the same
forward (Gemma 4's KV sharing): by layer type, what the storing layer's cache update returned."""

ROWS_TO_KEEP = "logits_to_keep"
"""A text model that takes it runs its last layers on the last ``logits_to_keep`` tokens alone (Gemma 4's
KV-shared layers, which write no cache: ``Gemma4TextModel._maybe_slice_kv_shared_inputs``)."""


def _parameters(forward: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(forward).parameters)


def _cache_name(parameters: tuple[str, ...], what: str) -> str:
    for name in CACHE_NAMES:
        if name in parameters:
            return name
    refuse(f"{what} takes its KV cache by none of the known names ({', '.join(CACHE_NAMES)})")


@dataclass(frozen=True)
class ModelContract:
    """The multimodal model's forward: its parameters in order, and the name it takes the cache by."""

    parameters: tuple[str, ...]
    cache: str
    slices_rows: bool = False

    def call(self, args: tuple, kwargs: dict) -> ModelCall:
        """The arguments of one call as a ``ModelCall``; a cache passed by a deprecated alias is moved to
        the current name (the forward would do the same)."""
        arguments = dict(zip(self.parameters, args, strict=False))
        arguments.update(kwargs)
        for alias in CACHE_NAMES:
            if alias != self.cache and alias in arguments:
                value = arguments.pop(alias)
                if arguments.get(self.cache) is None:
                    arguments[self.cache] = value
        return ModelCall(arguments, self.cache, self.slices_rows)


class ModelCall:
    """One call of the multimodal model, by what the engine reads and rewrites in it."""

    def __init__(self, arguments: dict, cache_name: str, slices_rows: bool = False) -> None:
        self.arguments = arguments
        self._cache = cache_name
        self._slices_rows = slices_rows

    @property
    def cache(self) -> Any:
        return self.arguments.get(self._cache)

    @property
    def input_ids(self) -> torch.Tensor | None:
        return self.arguments.get("input_ids")

    @property
    def _token_key(self) -> str:
        return "input_ids" if self.arguments.get("input_ids") is not None else "inputs_embeds"

    @property
    def new_tokens(self) -> int:
        """How many new tokens the call brings (input ids or embeddings)."""
        tokens = self.arguments.get(self._token_key)
        return 0 if tokens is None else tokens.shape[1]

    @property
    def attention_mask(self) -> Any:
        return self.arguments.get("attention_mask")

    def set_attention_mask(self, mask: Any) -> None:
        self.arguments["attention_mask"] = mask

    @property
    def position_ids(self) -> torch.Tensor | None:
        return self.arguments.get("position_ids")

    def set_position_ids(self, positions: torch.Tensor) -> None:
        self.arguments["position_ids"] = positions

    @property
    def has_raw_pixels(self) -> bool:
        """Whether the call brings raw images or video, which the vision tower encodes inside it."""
        return any(self.arguments.get(key) is not None for key in RAW_PIXEL_ARGUMENTS)

    @property
    def has_visual_inputs(self) -> bool:
        """Whether the call brings images (raw, or encoded by ``generate()`` before the prefill)."""
        encoded = self.arguments.get(ENCODED_INPUTS) or {}
        return self.has_raw_pixels or any(value is not None for value in encoded.values())

    def drop_leading(self, count: int) -> None:
        """Drop the first ``count`` new tokens (and the token-aligned arguments with them)."""
        key = self._token_key
        self.arguments[key] = self.arguments[key][:, count:]
        for name in TOKEN_ALIGNED:
            if isinstance(self.arguments.get(name), torch.Tensor):
                self.arguments[name] = self.arguments[name][..., count:]

    def run_every_row(self) -> None:
        """Make every decoder layer run on every token of a pruned prefill: a text model that would run
        its last layers on the last ``logits_to_keep`` tokens alone (``ROWS_TO_KEEP``) is passed 0, so
        that those layers, too, get the kept tokens the engine's hooks cut their inputs to. The model
        then returns the hidden states of every kept token (generate() reads the last one)."""
        if self._slices_rows and self.arguments.get(ROWS_TO_KEEP):
            self.arguments[ROWS_TO_KEEP] = 0

    def hook_result(self) -> tuple[tuple, dict]:
        """What a forward pre-hook returns to run the model on these arguments."""
        return (), self.arguments

    def split(self, end: int, cache: Any) -> tuple[ModelCall, ModelCall]:
        """This call cut before its ``end``-th token, both parts on ``cache``: the first part with the
        images, and the rest, its tokens and token-aligned arguments with the mask of the whole call
        (the images stay with the first part)."""
        first, rest = dict(self.arguments), {}
        for name in (self._token_key, "attention_mask", *TOKEN_ALIGNED):
            value = self.arguments.get(name)
            if isinstance(value, torch.Tensor):
                first[name] = value[..., :end]
                rest[name] = value if name == "attention_mask" else value[..., end:]
        first[self._cache] = rest[self._cache] = cache
        first["use_cache"] = rest["use_cache"] = True
        return ModelCall(first, self._cache, self._slices_rows), ModelCall(
            rest, self._cache, self._slices_rows
        )


@dataclass(frozen=True)
class LayerContract:
    """A decoder layer's forward: the name it takes the cache by (the other inputs are ``LAYER_INPUTS``),
    and where it takes arguments of one entry per token (``LAYER_TOKEN_INPUTS``): name -> position among
    the positional arguments."""

    cache: str
    token_inputs: tuple[tuple[str, int], ...] = ()

    def call(self, args: tuple, kwargs: dict) -> LayerCall:
        return LayerCall(args, kwargs, self.cache, self.token_inputs)


class LayerCall:
    """One call of a decoder layer: hidden states (first argument), RoPE, mask, cache, position ids, the
    per-token inputs and the shared keys and values of the families that have them."""

    def __init__(
        self, args: tuple, kwargs: dict, cache_name: str, token_inputs: tuple[tuple[str, int], ...] = ()
    ) -> None:
        self.args, self.kwargs = args, kwargs
        self._cache = cache_name
        self._token_inputs = token_inputs
        if "position_embeddings" not in kwargs or cache_name not in kwargs:
            missing = [name for name in ("position_embeddings", cache_name) if name not in kwargs]
            refuse(
                f"a decoder layer was called without {' or '.join(missing)}, which its signature names "
                "and priortr needs to prune"
            )

    @property
    def hidden(self) -> torch.Tensor:
        return self.args[0] if self.args else self.kwargs["hidden_states"]

    def set_hidden(self, hidden: torch.Tensor) -> None:
        if self.args:
            self.args = (hidden, *self.args[1:])
        else:
            self.kwargs["hidden_states"] = hidden

    @property
    def cache(self) -> Any:
        return self.kwargs[self._cache]

    @property
    def rope(self) -> tuple[torch.Tensor, ...]:
        """The layer's RoPE ``(cos, sin)``, each [B or 1, S, d]."""
        return self.kwargs["position_embeddings"]

    def set_rope(self, rope: tuple[torch.Tensor, ...]) -> None:
        self.kwargs["position_embeddings"] = rope

    @property
    def mask(self) -> Any:
        return self.kwargs.get("attention_mask")

    def set_mask(self, mask: Any) -> None:
        self.kwargs["attention_mask"] = mask

    def gather_token_inputs(self, index: torch.Tensor) -> None:
        """Keep positions ``index`` [B, S'] of each per-token input (``LAYER_TOKEN_INPUTS``) of the call,
        which came for the whole prompt; None stays None."""
        for name, position in self._token_inputs:
            if position < len(self.args):
                value = self.args[position]
                if isinstance(value, torch.Tensor):
                    self.args = (
                        *self.args[:position],
                        gather_sequence(value, index),
                        *self.args[position + 1 :],
                    )
            elif isinstance(self.kwargs.get(name), torch.Tensor):
                self.kwargs[name] = gather_sequence(self.kwargs[name], index)

    @property
    def shared_states(self) -> Any:
        """The keys and values layers of this forward pass to later ones (``SHARED_STATES``), or None."""
        return self.kwargs.get(SHARED_STATES)

    def shared_key_length(self, kind: str) -> int:
        """How many keys a layer that reads the shared entry ``kind`` attends over (host: a shape)."""
        return self.shared_states[kind][0].shape[2]

    def clear_positions(self) -> None:
        """Pass no position ids: RoPE arrives as gathered (cos, sin), and gapped ids would read as packed
        sequences to FlashAttention."""
        if "position_ids" in self.kwargs:
            self.kwargs["position_ids"] = None

    def hook_result(self) -> tuple[tuple, dict]:
        return self.args, self.kwargs


SEQUENCE_OUTPUTS = ("last_hidden_state", "logits")
"""Outputs with one entry per token: a multimodal model's hidden states, or the logits of one that is its
own causal LM (Llama 4)."""


def join_outputs(
    first: ModelOutput, second: ModelOutput, keep_cache: bool, logits_to_keep: Any = 0
) -> ModelOutput:
    """``first``, a multimodal model's output, extended by ``second``, the output of the call that
    continued its cache: the hidden states (or logits) of both, one after the other, of which the last
    ``logits_to_keep`` logits when the call asked for them (0: all), and the cache (None when the caller
    asked for none)."""
    if not isinstance(first, ModelOutput) or not isinstance(second, ModelOutput):
        refuse(f"the multimodal model returned a {type(first).__name__}, not a ModelOutput")
    for name in SEQUENCE_OUTPUTS:
        if first.get(name) is None:
            continue
        joined = torch.cat([first[name], second[name]], dim=1)
        if name == "logits" and logits_to_keep:
            if not isinstance(logits_to_keep, int):
                raise ValueError(
                    "logits_to_keep as indices on a call that carries a continuation after its prompt: the "
                    "prompt's logits are of its kept tokens only; pass an int"
                )
            joined = joined[:, -logits_to_keep:]
        first[name] = joined
    field = cache_field(first)
    if not keep_cache and field is not None:
        first[field] = None
    return first


def cache_field(output: ModelOutput) -> str | None:
    """The field a model output holds its cache in (``cache`` from 5.24, ``past_key_values`` before); None
    for an output without one. Read from the output class's fields: asking a 5.24 output for the old
    name (``in``, ``get``, an attribute) logs transformers' deprecation warning, as if the user had."""
    names = (
        {field.name for field in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else set()
    )
    return next((name for name in CACHE_NAMES if name in names), None)


def resolve(
    multimodal: nn.Module, layers: nn.ModuleList, language_model: nn.Module | None = None
) -> tuple[ModelContract, LayerContract]:
    """The call contracts of ``multimodal`` (the module whose forward takes the prompt and the cache) and
    of its decoder ``layers``, and whether ``language_model`` (the module that runs them) runs its last
    layers on fewer tokens (``ROWS_TO_KEEP``); refuses a release or a model whose signatures match none."""
    check_release()
    model_parameters = _parameters(multimodal.forward)
    slices = language_model is not None and ROWS_TO_KEEP in _parameters(language_model.forward)
    model = ModelContract(model_parameters, _cache_name(model_parameters, type(multimodal).__name__), slices)
    names = set()
    token_inputs = set()
    for layer_type in {type(layer) for layer in layers}:
        parameters = _parameters(layer_type.forward)
        token_inputs |= {
            (name, parameters.index(name) - 1) for name in LAYER_TOKEN_INPUTS if name in parameters
        }
        what = f"decoder layer {layer_type.__name__}"
        missing = [name for name in LAYER_INPUTS if name not in parameters]
        if missing:
            refuse(f"{what} takes no {', '.join(missing)}")
        if parameters[1] != LAYER_INPUTS[0]:  # parameters[0] is self
            refuse(f"{what} takes {parameters[1]!r} first, not the hidden states")
        names.add(_cache_name(parameters, what))
    if len(names) != 1:
        refuse(f"the decoder layers take their cache by different names ({', '.join(sorted(names))})")
    return model, LayerContract(names.pop(), tuple(sorted(token_inputs)))
