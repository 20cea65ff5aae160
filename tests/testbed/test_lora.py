"""The testbed's LoRA: a merged adapter computes what the wrapped projection computed."""

import pytest
import torch
from torch import nn

from priortr.testbed import lora


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(6, 6, bias=False), nn.Linear(6, 2, bias=False)
        self.v_proj, self.o_proj = nn.Linear(6, 2, bias=False), nn.Linear(6, 6, bias=False)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention()
        self.mlp = nn.Module()
        self.mlp.q_proj = nn.Linear(6, 6)  # a same-named projection outside attention stays untouched


def test_merge_reproduces_the_adapted_projection():
    torch.manual_seed(0)
    plain, adapted = Layer(), Layer()
    adapted.load_state_dict(plain.state_dict())
    params = lora.add(adapted, rank=2, alpha=4.0)
    assert len(params) == 8 and isinstance(adapted.mlp.q_proj, nn.Linear)
    with torch.no_grad():
        for p in params:
            p.normal_()
    x = torch.randn(3, 6)
    before = plain.self_attn.q_proj(x)
    lora.merge(plain, lora.state(adapted), alpha=4.0)
    for name in lora.TARGETS:
        torch.testing.assert_close(getattr(plain.self_attn, name)(x), getattr(adapted.self_attn, name)(x))
    a, b = adapted.self_attn.q_proj.lora_a, adapted.self_attn.q_proj.lora_b
    torch.testing.assert_close(plain.self_attn.q_proj(x) - before, x @ a.T @ b.T * 2.0)


def test_a_fresh_adapter_changes_nothing():
    layer = Layer()
    x = torch.randn(3, 6)
    before = layer.self_attn.o_proj(x)
    lora.add(layer, rank=2, alpha=4.0)
    torch.testing.assert_close(layer.self_attn.o_proj(x), before)


def test_merge_refuses_an_adapter_without_a_projection():
    with pytest.raises(ValueError, match="no matching projection"):
        lora.merge(
            Layer(),
            {"self_attn.x_proj.lora_a": torch.zeros(2, 6), "self_attn.x_proj.lora_b": torch.zeros(6, 2)},
            4.0,
        )


def test_load_puts_saved_adapters_back_for_resuming():
    torch.manual_seed(0)
    trained, resumed = Layer(), Layer()
    resumed.load_state_dict(trained.state_dict())
    with torch.no_grad():
        for p in lora.add(trained, rank=2, alpha=4.0):
            p.normal_()
    lora.add(resumed, rank=2, alpha=4.0)
    x = torch.randn(3, 6)
    assert not torch.allclose(resumed.self_attn.v_proj(x), trained.self_attn.v_proj(x))
    lora.load(resumed, lora.state(trained))
    for name in lora.TARGETS:
        torch.testing.assert_close(getattr(resumed.self_attn, name)(x), getattr(trained.self_attn, name)(x))
