"""RMSNorm whose scale is applied in fp32 before casting back (GPT-OSS keeps its norms in fp32)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from xtl.ops.selector import hf_impl_enabled


def get_fp32_scale_rms_norm_fn() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """transformers' exact op order under ``XTL_HF_IMPL``, else the fused torch op (same placement of the cast)."""
    return fp32_scale_rms_norm_hf if hf_impl_enabled() else fp32_scale_rms_norm_fused


def fp32_scale_rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(weight * (x * rsqrt(mean(x**2) + eps))).to(x.dtype)`` with statistics and scale in fp32."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return (weight.float() * hidden).to(x.dtype)


def fp32_scale_rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same as :func:`fp32_scale_rms_norm_hf` through ``torch.nn.functional.rms_norm``."""
    return (weight.float() * F.rms_norm(x.float(), (x.shape[-1],), eps=eps)).to(x.dtype)
