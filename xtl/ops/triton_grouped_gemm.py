"""Triton grouped GEMM for MoE experts, with its backward.

Forward and input gradient use one kernel (``out[rows_e] = a[rows_e] @ b[e]``, ``b`` of any strides); the weight
gradient uses a second kernel that reduces over each expert's rows (``db[e] = a[rows_e].T @ g[rows_e]``), which
writes zeros for experts without rows. Accumulation is in fp32; fp32 inputs use IEEE (no TF32) products.

With ``TRITON_INTERPRET=1`` set before triton is imported, the kernels run in triton's interpreter on CPU
tensors (how the tests check them without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def triton_grouped_mm(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``out[rows_e] = x[rows_e] @ w[e]`` for ``x (M, K)``, ``w (E, K, N)``; differentiable in ``x`` and ``w``.

    Args:
        x: Rows grouped by expert.
        w: Per-expert weights (any strides).
        tokens_per_expert: ``(E,)`` row count of each expert (sums to M).
    """
    offsets = torch.zeros(tokens_per_expert.numel() + 1, dtype=torch.int64, device=x.device)
    offsets[1:] = torch.cumsum(tokens_per_expert.to(device=x.device, dtype=torch.int64), 0)
    return _TritonGroupedMM.apply(x, w, offsets)


class _TritonGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, w, offsets)
        return _grouped_mm(x, w, offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # noqa: ANN001
        x, w, offsets = ctx.saved_tensors
        grad_x = _grouped_mm(grad, w.transpose(1, 2), offsets)
        grad_w = _grouped_wgrad(x, grad, offsets, w.dtype)
        return grad_x, grad_w, None


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    num_rows, k = a.shape
    num_experts, _, n = b.shape
    out = a.new_empty(num_rows, n)
    if num_rows == 0:
        return out
    block_m, block_n, block_k = _blocks(a)
    max_rows = int((offsets[1:] - offsets[:-1]).max())
    grid = (num_experts, triton.cdiv(max(max_rows, 1), block_m), triton.cdiv(n, block_n))
    _grouped_mm_kernel[grid](
        a, b, out, offsets, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=a.dtype == torch.float32,
    )  # fmt: skip
    return out


def _grouped_wgrad(a: torch.Tensor, g: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    k, n = a.shape[1], g.shape[1]
    num_experts = offsets.numel() - 1
    out = torch.empty(num_experts, k, n, dtype=dtype, device=a.device)
    block_m, block_n, block_k = _blocks(a)
    grid = (num_experts, triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    _grouped_wgrad_kernel[grid](
        a, g, out, offsets, k, n,
        a.stride(0), a.stride(1), g.stride(0), g.stride(1), out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=a.dtype == torch.float32,
    )  # fmt: skip
    return out


def _blocks(a: torch.Tensor) -> tuple[int, int, int]:
    return (64, 64, 32) if a.is_cuda else (16, 16, 16)


@triton.jit
def _grouped_mm_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr, N, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(0)
    start = tl.load(offs_ptr + expert)
    end = tl.load(offs_ptr + expert + 1)
    row0 = start + tl.program_id(1) * BLOCK_M
    if row0 < end:
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + rk
            a = tl.load(
                a_ptr + rm[:, None] * stride_am + ks[None, :] * stride_ak,
                mask=(rm[:, None] < end) & (ks[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                b_ptr + expert * stride_be + ks[:, None] * stride_bk + rn[None, :] * stride_bn,
                mask=(ks[:, None] < K) & (rn[None, :] < N),
                other=0.0,
            )
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        mask = (rm[:, None] < end) & (rn[None, :] < N)
        tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, g_ptr, out_ptr, offs_ptr, K, N,
    stride_am, stride_ak, stride_gm, stride_gn, stride_oe, stride_ok, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(0)
    start = tl.load(offs_ptr + expert)
    end = tl.load(offs_ptr + expert + 1)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + rm
        a = tl.load(
            a_ptr + rows[None, :] * stride_am + rk[:, None] * stride_ak,
            mask=(rows[None, :] < end) & (rk[:, None] < K),
            other=0.0,
        )
        g = tl.load(
            g_ptr + rows[:, None] * stride_gm + rn[None, :] * stride_gn,
            mask=(rows[:, None] < end) & (rn[None, :] < N),
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(a, g, input_precision="ieee")
        else:
            acc += tl.dot(a, g)
    mask = (rk[:, None] < K) & (rn[None, :] < N)
    out = out_ptr + expert * stride_oe + rk[:, None] * stride_ok + rn[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
