"""The fused-projection ops: one matmul split into views, or one matmul per part bitwise as separate layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from xtl.ops.fused_linear import get_fused_projection_fn, project_fused, project_parts
from xtl.ops.selector import hf_impl

SIZES = (32, 8, 8)


@pytest.fixture
def layers():
    torch.manual_seed(0)
    fused = nn.Linear(24, sum(SIZES), bias=True)
    separate = [nn.Linear(24, n, bias=True) for n in SIZES]
    with torch.no_grad():
        for layer, w, b in zip(separate, fused.weight.split(SIZES), fused.bias.split(SIZES)):
            layer.weight.copy_(w)
            layer.bias.copy_(b)
    return fused, separate


class TestFusedProjection:
    def test_selector_follows_the_parity_switch(self):
        with hf_impl(True):
            assert get_fused_projection_fn() is project_parts
        with hf_impl(False):
            assert get_fused_projection_fn() is project_fused

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_parts_are_bitwise_the_separate_layers_with_gradients(self, layers, dtype):
        fused, separate = (m.to(dtype) for m in (layers[0], nn.ModuleList(layers[1])))
        x = torch.randn(3, 5, 24, dtype=dtype, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        got, ref = project_parts(x, fused, SIZES), [layer(x_ref) for layer in separate]
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
        sum((p * (i + 1)).sum() for i, p in enumerate(got)).backward()
        sum((p * (i + 1)).sum() for i, p in enumerate(ref)).backward()
        assert torch.equal(x.grad, x_ref.grad)
        assert torch.equal(fused.weight.grad, torch.cat([layer.weight.grad for layer in separate]))
        assert torch.equal(fused.bias.grad, torch.cat([layer.bias.grad for layer in separate]))

    def test_fused_is_one_linear_split_into_views(self, layers, monkeypatch):
        fused, separate = layers
        calls = []
        monkeypatch.setattr(fused, "forward", lambda x: calls.append(x) or F.linear(x, fused.weight, fused.bias))
        x = torch.randn(4, 24)
        parts = project_fused(x, fused, SIZES)
        assert len(calls) == 1 and [p.shape[-1] for p in parts] == list(SIZES)
        assert all(p.untyped_storage().data_ptr() == parts[0].untyped_storage().data_ptr() for p in parts)
        for part, layer in zip(parts, separate):
            torch.testing.assert_close(part, layer(x), rtol=1e-6, atol=1e-6)

    def test_a_module_other_than_a_plain_linear_is_called_once(self, layers):
        class Scaled(nn.Linear):  # e.g. an fp8 linear: its weight is not what its forward multiplies by
            def forward(self, x):
                return 2 * super().forward(x)

        fused = Scaled(24, sum(SIZES))
        x = torch.randn(4, 24)
        for got, want in zip(project_parts(x, fused, SIZES), (2 * fused(x) / 2).split(SIZES, dim=-1)):
            assert torch.equal(got, want)
