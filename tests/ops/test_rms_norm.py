"""The CPU fp32 fast path of :func:`xtl.ops.rms_norm.rms_norm_hf` (one ``F.rms_norm`` call) against the op-by-op
transformers formula, forward and backward, bitwise."""

from __future__ import annotations

import pytest
import torch

from xtl.ops.rms_norm import rms_norm_hf


def _transformers_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype)


@pytest.mark.parametrize("shape", [(8, 1, 128), (8, 1, 4, 32), (2, 37, 100), (1, 3, 4096)])
def test_fp32_fast_path_is_bitwise_the_op_by_op_formula(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).requires_grad_()
    weight = torch.randn(shape[-1], generator=gen).requires_grad_()
    grad = torch.randn(shape, generator=gen)
    fast = rms_norm_hf(x, weight, 1e-6)
    reference = _transformers_rms_norm(x, weight, 1e-6)
    assert torch.equal(fast, reference)
    for a, b in zip(torch.autograd.grad(fast, (x, weight), grad), torch.autograd.grad(reference, (x, weight), grad)):
        assert torch.equal(a, b)


def test_bf16_keeps_transformers_op_order() -> None:
    """16-bit inputs take the op-by-op path: the scale multiplies after the cast back, as transformers does."""
    x = torch.randn(4, 64).bfloat16()
    weight = torch.randn(64)
    out = rms_norm_hf(x, weight, 1e-6)
    assert out.dtype == torch.float32
    assert torch.equal(out, _transformers_rms_norm(x, weight, 1e-6))
