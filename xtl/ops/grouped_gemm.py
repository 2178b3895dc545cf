"""Grouped GEMM (one matmul per expert over contiguous row groups) behind one selector.

Every implementation computes, for rows grouped by expert (``tokens_per_expert[e]`` consecutive rows for expert
``e``), ``out[rows_e] = x[rows_e] @ w[e]`` with ``x (M, K)``, ``w (E, K, N)`` (any strides, so a transposed view
of an ``(E, N, K)`` parameter works) and returns ``(M, N)``. Experts that receive no rows are allowed; their
weight gradient is zero.

- ``loop``: one ``matmul`` per expert (any device; bitwise equal to transformers' eager expert loop).
- ``torch``: ``torch._grouped_mm`` (CUDA, bf16, compute capability >= 9.0).
- ``triton``: the triton kernel of :mod:`xtl.ops.triton_grouped_gemm` (CUDA, or CPU under ``TRITON_INTERPRET=1``).

``auto`` picks ``torch``, then ``triton`` on CUDA, and ``loop`` elsewhere. ``XTL_HF_IMPL=1`` always gives ``loop``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from xtl.ops.selector import hf_impl_enabled

GROUPED_GEMM_IMPLS = ("auto", "loop", "torch", "triton")

GroupedGemmFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def get_grouped_gemm_fn(name: str = "auto") -> GroupedGemmFn:
    """Return the grouped GEMM ``fn(x, w, tokens_per_expert) -> out`` for ``name``.

    Args:
        name: One of ``auto``, ``loop``, ``torch``, ``triton``.

    Raises:
        ValueError: For an unknown name.
    """
    if name not in GROUPED_GEMM_IMPLS:
        raise ValueError(f"unknown grouped gemm implementation {name!r}; choose one of {GROUPED_GEMM_IMPLS}")
    if hf_impl_enabled() or name == "loop":
        return grouped_gemm_loop
    if name == "torch":
        return grouped_gemm_torch
    if name == "triton":
        return grouped_gemm_triton
    return grouped_gemm_auto


def grouped_gemm_auto(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Pick the fastest implementation for these tensors at call time (see the module docstring)."""
    if x.is_cuda:
        if torch_grouped_mm_supported(x, w):
            return grouped_gemm_torch(x, w, tokens_per_expert)
        if importlib.util.find_spec("triton") is not None:
            return grouped_gemm_triton(x, w, tokens_per_expert)
    return grouped_gemm_loop(x, w, tokens_per_expert)


def grouped_gemm_loop(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Reference: one ``matmul`` per expert that has rows (one host sync for the counts)."""
    counts = _check(x, w, tokens_per_expert).tolist()
    outs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            outs.append(x[start : start + count] @ w[expert])
        start += count
    if start != x.shape[0]:
        raise ValueError(f"tokens_per_expert sums to {start} but x has {x.shape[0]} rows")
    if not outs:
        return x[:0] @ w[0]  # (0, N), still connected to x and w
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def grouped_gemm_torch(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` with an explicit backward (also correct for experts without rows)."""
    offsets = torch.cumsum(_check(x, w, tokens_per_expert), 0).to(torch.int32)
    return _TorchGroupedMM.apply(x, w, offsets)


def grouped_gemm_triton(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The triton grouped GEMM (forward and both backward products are triton kernels)."""
    from xtl.ops.triton_grouped_gemm import triton_grouped_mm

    return triton_grouped_mm(x, w, _check(x, w, tokens_per_expert))


def torch_grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs natively for these tensors (CUDA, bf16, sm90+, 16-byte aligned dims)."""
    if not (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == w.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0


class _TorchGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x, w, offsets)
        return torch._grouped_mm(x, w, offs=offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # noqa: ANN001
        x, w, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offsets)
        grad_w = torch._grouped_mm(x.t(), grad, offs=offsets)
        return grad_x, grad_w, None


def _check(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped gemm needs x (M, K) and w (E, K, N); got {tuple(x.shape)} and {tuple(w.shape)}")
    if tokens_per_expert.numel() != w.shape[0]:
        raise ValueError(f"tokens_per_expert has {tokens_per_expert.numel()} entries for {w.shape[0]} experts")
    return tokens_per_expert.to(device=x.device, dtype=torch.int64)
