"""RMSNorm implementations (alone, and fused with the residual add before it) behind selectors."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

from xtl.ops.selector import hf_impl_enabled

RMSNormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
AddRMSNormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


def get_rms_norm_fn(device: torch.device | None = None) -> RMSNormFn:
    """Return the RMSNorm op for inputs on ``device``.

    transformers' exact op order under ``XTL_HF_IMPL`` and off CUDA (on CPU the unfused ops are as fast as
    ``F.rms_norm``, measured in ``benchmarks/model_step.py``); the fused torch kernel on CUDA.
    """
    if hf_impl_enabled() or device is None or device.type != "cuda":
        return rms_norm_hf
    return rms_norm_fused


def get_add_rms_norm_fn(device: torch.device | None = None) -> AddRMSNormFn:
    """Return the residual add + RMSNorm op ``fn(x, residual, weight, eps) -> (normed, summed)`` for ``device``.

    ``summed = residual + x`` and ``normed = rms_norm(summed) * weight``. Under ``XTL_HF_IMPL`` and off CUDA:
    :func:`add_rms_norm_torch`, the same ops as the unfused add then :func:`rms_norm_hf`; on CUDA
    :func:`add_rms_norm_triton` (one pass over the row for both), or :func:`add_rms_norm_fused` (the unfused
    add then what :func:`get_rms_norm_fn` picks on CUDA) where triton is not installed.

    Args:
        device: Where the inputs live (``None``: not CUDA).
    """
    if hf_impl_enabled() or device is None or device.type != "cuda":
        return add_rms_norm_torch
    if importlib.util.find_spec("triton") is None:
        return add_rms_norm_fused
    return add_rms_norm_triton


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed = residual + x``, then :func:`rms_norm_hf` of it; returns ``(normed, summed)``.

    Bitwise the unfused ``residual + x`` followed by an :class:`~xtl.module.norm.RMSNorm` off CUDA.
    """
    summed = residual + x
    return rms_norm_hf(summed, weight, eps), summed


def add_rms_norm_fused(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed = residual + x``, then :func:`rms_norm_fused` of it; returns ``(normed, summed)``."""
    summed = residual + x
    return rms_norm_fused(summed, weight, eps), summed


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm_torch` through the triton kernel of :mod:`xtl.ops.triton_rms_norm` (imported on call).

    Statistics and products in fp32 with transformers' roundings; differentiable in ``x``, ``residual`` and
    ``weight``. Inputs the kernel does not cover (different shapes or dtypes of ``x`` and ``residual``, rows longer
    than 65536) go to :func:`add_rms_norm_fused`.
    """
    from xtl.ops.triton_rms_norm import add_rms_norm_supported, triton_add_rms_norm

    if not add_rms_norm_supported(x, residual, weight):
        return add_rms_norm_fused(x, residual, weight, eps)
    return triton_add_rms_norm(x, residual, weight, eps)


def rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with transformers' op order: fp32 statistics, cast back, then scale.

    For fp32 ``x`` and ``weight`` on CPU this is one ``torch.nn.functional.rms_norm`` call: its CPU kernel runs
    these very ops (forward and backward bitwise equal, ``tests/ops/test_rms_norm.py``) without a Python call per
    op, which counts in decoding, where each op is small.
    """
    if x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm through ``torch.nn.functional.rms_norm`` in fp32 (one fused kernel where the build has it)."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)
