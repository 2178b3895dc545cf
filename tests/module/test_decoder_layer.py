"""The decoder layer's residual add + post-attention norm: one call of the norm module, through the fused-op
selector for a plain RMSNorm, bitwise the unfused add then norm off CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import xtl.module.norm as norm_module
from xtl.module.decoder_layer import DecoderLayer
from xtl.module.fp32_norm import Fp32ScaleRMSNorm
from xtl.module.moe_block import MoEDecoderLayer
from xtl.module.norm import RMSNorm
from xtl.ops.rms_norm import add_rms_norm_torch

EPS = 1e-6


@pytest.fixture
def selector_calls(monkeypatch) -> list[torch.device]:
    """The devices :func:`xtl.ops.get_add_rms_norm_fn` is asked for (it hands out the torch reference)."""
    calls = []

    def spy(device: torch.device):
        calls.append(device)
        return add_rms_norm_torch

    monkeypatch.setattr(norm_module, "get_add_rms_norm_fn", spy)
    return calls


class TestAddAndPostAttentionNorm:
    def test_plain_rms_norm_goes_through_the_fused_selector_bitwise(self, selector_calls):
        layer, hidden = _layer(RMSNorm)
        out = layer(hidden, (None, None), None)
        (grad,) = torch.autograd.grad(out.sum(), hidden)
        assert selector_calls == [hidden.device]
        ref_out, ref_grad = _unfused_layer(layer, hidden)
        assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)

    def test_moe_layer_goes_through_the_fused_selector_bitwise(self, selector_calls):
        layer, hidden = _layer(RMSNorm, MoEDecoderLayer)
        out, routing = layer(hidden, (None, None), None)
        (grad,) = torch.autograd.grad(out.sum(), hidden)
        assert selector_calls == [hidden.device] and routing == "routing"
        ref_out, ref_grad = _unfused_layer(layer, hidden)
        assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)

    def test_fp32_scale_norm_adds_then_normalizes_bitwise(self, monkeypatch):
        monkeypatch.setattr(norm_module, "get_add_rms_norm_fn", lambda device: pytest.fail("fused op used"))
        layer, hidden = _layer(Fp32ScaleRMSNorm)
        out = layer(hidden, (None, None), None)
        (grad,) = torch.autograd.grad(out.sum(), hidden)
        ref_out, ref_grad = _unfused_layer(layer, hidden)
        assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)

    def test_the_norm_is_called_as_a_module(self):
        """Hooks and patched forwards of the post-attention norm (``xtl memory --measure``) still see the call."""
        layer, hidden = _layer(RMSNorm)
        seen = []
        layer.post_attention_layernorm.register_forward_hook(lambda module, args, out: seen.append(len(args)))
        layer(hidden, (None, None), None)
        assert seen == [2]


class _Scale(nn.Module):
    def __init__(self, width: int, seed: int, routed: bool = False) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(width, generator=torch.Generator().manual_seed(seed)))
        self.routed = routed

    def forward(self, h: torch.Tensor, *_: object) -> torch.Tensor | tuple[torch.Tensor, str]:
        out = torch.tanh(h * self.scale)
        return (out, "routing") if self.routed else out


def _layer(
    norm_class: type[RMSNorm], layer_class: type[DecoderLayer] = DecoderLayer
) -> tuple[DecoderLayer, torch.Tensor]:
    mlp = _Scale(32, 2, routed=layer_class is MoEDecoderLayer)
    layer = layer_class(_Scale(32, 1), mlp, 32, EPS, norm_class)
    with torch.no_grad():
        layer.post_attention_layernorm.weight.normal_(generator=torch.Generator().manual_seed(3))
    hidden = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).requires_grad_()
    return layer.to(torch.bfloat16), hidden


def _unfused_layer(layer: DecoderLayer, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer as transformers writes it: add, then the norm alone."""
    h = hidden + layer.self_attn(layer.input_layernorm(hidden), (None, None), None, None)
    mlp_out = layer.mlp(layer.post_attention_layernorm(h))
    out = h + (mlp_out[0] if isinstance(mlp_out, tuple) else mlp_out)
    return out, torch.autograd.grad(out.sum(), hidden)[0]
