"""RMSNorm applying its scale in fp32 (GPT-OSS)."""

from __future__ import annotations

import torch

from xtl.module.norm import RMSNorm
from xtl.ops.rms_norm_fp32 import get_fp32_scale_rms_norm_fn


class Fp32ScaleRMSNorm(RMSNorm):
    """``(weight * normalize(x)).to(x.dtype)`` with the product in fp32, as a norm kept in fp32 computes it."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize the last dimension of ``x``; with ``residual``, add it first and return ``(normed, summed)``
        (no fused kernel: the add, then the norm)."""
        if residual is not None:
            summed = residual + x
            return get_fp32_scale_rms_norm_fn()(summed, self.weight, self.eps), summed
        return get_fp32_scale_rms_norm_fn()(x, self.weight, self.eps)
