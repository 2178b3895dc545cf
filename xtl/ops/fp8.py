"""Blockwise fp8 linear for training: 1x128 activation groups, 128x128 weight blocks (DeepSeek-V3 style).

Every operand of the three matmuls of a linear layer is quantized to ``float8_e4m3fn`` with one amax scale per
group (torchao's scaling: ``s = 448 / max(amax, 1e-12)`` in float64 then float32, ``fp8 = saturate(x * s)``
rounded to nearest even, ``scale_inv = 1 / s``):

- forward ``out = x @ W.T``: ``x`` in 1x128 groups along K, ``W`` in 128x128 blocks;
- ``grad_x = grad_out @ W``: ``grad_out`` in 1x128 groups along N, ``W`` in 128x128 blocks;
- ``grad_W = grad_out.T @ x``: both in groups of 128 tokens (``grad_out.T`` 1x128, ``x`` 128x1).

Two paths compute it (:func:`blockwise_fp8_path`):

- ``torchao`` (CUDA, compute capability >= 9.0): torchao's ``fp8_blockwise_mm``
  (``torchao.prototype.blockwise_fp8_training``): triton quantize kernels and ``F.scaled_mm`` with block scales,
  bf16 output.
- ``reference`` (any other device; CPU, whose ``_scaled_mm`` rejects block scales with "Invalid scaling
  configuration"): the same quantization with torchao's torch reference quantizers, dequantized to float32, then
  a float32 matmul. The rounding of every operand is the GPU path's; only the accumulation order differs.

The token count is padded to a multiple of 128 with zero rows (a zero row changes no group's amax and adds nothing to
``grad_W``); the weight's dims must be multiples of 128 (layers that are not stay in high precision, see
``xtl.callbacks.FP8Training``). torchao is imported on first use (``pip install xtl[fp8]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

BLOCK = 128

BlockwisePath = Literal["torchao", "reference"]


def blockwise_fp8_path(device: torch.device | str) -> BlockwisePath:
    """The implementation :func:`blockwise_fp8_linear` uses on ``device`` (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (9, 0):
        return "torchao"
    return "reference"


def blockwise_fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with fp8 blockwise matmuls in forward and backward (differentiable).

    Args:
        x: ``(..., K)`` input.
        weight: ``(N, K)`` weight, ``N`` and ``K`` multiples of 128.
        bias: Optional ``(N,)`` bias, added in the input dtype.

    Returns:
        ``(..., N)`` in ``x``'s dtype.

    Raises:
        ValueError: A weight dim is not a multiple of 128.
    """
    if weight.shape[0] % BLOCK or weight.shape[1] % BLOCK:
        raise ValueError(f"blockwise fp8 needs weight dims that are multiples of {BLOCK}; got {tuple(weight.shape)}")
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows % BLOCK:
        flat = F.pad(flat, (0, 0, 0, BLOCK - rows % BLOCK))
    if blockwise_fp8_path(flat.device) == "torchao":
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        out = fp8_blockwise_mm.apply(flat.contiguous(), weight, BLOCK, torch.bfloat16, False).to(x.dtype)
    else:
        out = _BlockwiseFp8Reference.apply(flat, weight)
    out = out[:rows].reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2D tensor in groups of 128 along its last dim (torchao's torch reference quantizer).

    Returns:
        The ``float8_e4m3fn`` tensor and the float32 ``scale_inv`` of shape ``(rows, cols / 128)``.
    """
    from torchao.prototype.blockwise_fp8_training.kernels import torch_blockwise_scale_act_quant_lhs

    q, scale_inv = torch_blockwise_scale_act_quant_lhs(x.contiguous(), BLOCK)
    return q, scale_inv.contiguous()


def quantize_128x128(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2D weight in 128x128 blocks (torchao's torch reference quantizer).

    Returns:
        The ``float8_e4m3fn`` weight and the float32 ``scale_inv`` of shape ``(rows / 128, cols / 128)``.
    """
    from torchao.prototype.blockwise_fp8_training.kernels import torch_blockwise_scale_weight_quant

    return torch_blockwise_scale_weight_quant(weight.contiguous(), BLOCK)


def dequantize_blockwise(
    qweight: torch.Tensor, scale_inv: torch.Tensor, block: int | Sequence[int] = BLOCK
) -> torch.Tensor:
    """``q.float() * scale_inv`` with every scale broadcast over its block (partial blocks at the edges allowed).

    Args:
        qweight: fp8 tensor, 2D or a 3D stack.
        scale_inv: One scale per block, ``(..., ceil(rows / block_rows), ceil(cols / block_cols))``.
        block: Block edge, or ``(block_rows, block_cols)`` (``(1, 128)`` for activation groups).

    Returns:
        The float32 tensor.
    """
    block_rows, block_cols = (block, block) if isinstance(block, int) else block
    rows, cols = qweight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return qweight.float() * scale[..., :rows, :cols]


class _BlockwiseFp8Reference(torch.autograd.Function):
    """The reference path: quantize -> dequantize -> float32 matmul, with torchao's backward quantization."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, weight)
        return (_fake_quant_1x128(x) @ _fake_quant_128x128(weight).t()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        x, weight = ctx.saved_tensors
        grad_x = _fake_quant_1x128(grad_out) @ _fake_quant_128x128(weight)
        grad_weight = _fake_quant_1x128(grad_out.t()) @ _fake_quant_1x128(x.t()).t()
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


def _fake_quant_1x128(x: torch.Tensor) -> torch.Tensor:
    return dequantize_blockwise(*quantize_1x128(x), block=(1, BLOCK))


def _fake_quant_128x128(weight: torch.Tensor) -> torch.Tensor:
    return dequantize_blockwise(*quantize_128x128(weight), block=BLOCK)
