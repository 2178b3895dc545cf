"""RMSNorm implementations behind one selector."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from xtl.ops.selector import hf_impl_enabled

RMSNormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def get_rms_norm_fn(device: torch.device | None = None) -> RMSNormFn:
    """Return the RMSNorm op for inputs on ``device``.

    transformers' exact op order under ``XTL_HF_IMPL`` and off CUDA (on CPU the unfused ops are as fast as
    ``F.rms_norm``, measured in ``benchmarks/model_step.py``); the fused torch kernel on CUDA.
    """
    if hf_impl_enabled() or device is None or device.type != "cuda":
        return rms_norm_hf
    return rms_norm_fused


def rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with transformers' op order: fp32 statistics, cast back, then scale."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm through ``torch.nn.functional.rms_norm`` in fp32 (one fused kernel where the build has it)."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)
