"""Low-rank adapters on SmolLM2's attention projections: trained in ``train``, merged at assembly.

The shipped checkpoint is a stock ``LlavaForConditionalGeneration``: ``merge`` folds each adapter into
its projection (W += alpha / r * B A, Hu et al. 2021), so no wrapper module survives training.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


def _targets(language_model: nn.Module):
    for name, module in language_model.named_modules():
        for child in TARGETS:
            if name.rsplit(".", 1)[-1] == "self_attn" and isinstance(
                getattr(module, child, None), nn.Linear | LoRALinear
            ):
                yield f"{name}.{child}", module, child


def add(language_model: nn.Module, rank: int, alpha: float) -> list[nn.Parameter]:
    """Wrap every attention projection; returns the new trainable parameters."""
    params = []
    for _, parent, child in list(_targets(language_model)):
        wrapped = LoRALinear(getattr(parent, child), rank, alpha)
        setattr(parent, child, wrapped)
        params += [wrapped.lora_a, wrapped.lora_b]
    return params


def state(language_model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as ``{"<module>.lora_a": A, "<module>.lora_b": B}``."""
    out = {}
    for name, parent, child in _targets(language_model):
        module = getattr(parent, child)
        out[f"{name}.lora_a"] = module.lora_a.detach().clone()
        out[f"{name}.lora_b"] = module.lora_b.detach().clone()
    return out


@torch.no_grad()
def load(language_model: nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    """Put ``adapters`` (as written by ``state``) back into the wrapped projections, to resume training."""
    for name, parent, child in _targets(language_model):
        module = getattr(parent, child)
        module.lora_a.copy_(adapters[f"{name}.lora_a"])
        module.lora_b.copy_(adapters[f"{name}.lora_b"])


@torch.no_grad()
def merge(language_model: nn.Module, adapters: dict[str, torch.Tensor], alpha: float) -> None:
    """Fold ``adapters`` (as written by ``state``) into the plain projections of ``language_model``."""
    modules = dict(language_model.named_modules())
    names = {key.rsplit(".", 1)[0] for key in adapters}
    for name in sorted(names):
        if name not in modules or not isinstance(modules[name], nn.Linear):
            raise ValueError(f"adapter {name!r} has no matching projection in the language model")
        a, b = adapters[f"{name}.lora_a"].float(), adapters[f"{name}.lora_b"].float()
        weight = modules[name].weight
        weight += (b @ a * (alpha / a.shape[0])).to(weight.dtype)
