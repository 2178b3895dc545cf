"""Normalization layers."""

from __future__ import annotations

import torch
from torch import nn

from xtl.ops.rms_norm import get_rms_norm_fn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm; the op is chosen per call by :func:`xtl.ops.get_rms_norm_fn`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dimension of ``x``."""
        return get_rms_norm_fn(x.device)(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        """Set the scale to ones."""
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
