"""Normalization layers."""

from __future__ import annotations

import torch
from torch import nn

from xtl.ops.rms_norm import get_add_rms_norm_fn, get_rms_norm_fn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm; the op is chosen per call by :func:`xtl.ops.get_rms_norm_fn`.

    Called with a ``residual`` it also adds it first, through :func:`xtl.ops.get_add_rms_norm_fn` (one fused kernel on
    CUDA; off CUDA the same ops as the add followed by the norm): a decoder layer's residual add and its
    post-attention norm are one module call, so hooks and patches of the norm still see it.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize the last dimension of ``x``; with ``residual``, of ``residual + x``.

        Returns:
            The normalized tensor; with ``residual``, ``(normalized, residual + x)``.
        """
        if residual is not None:
            return get_add_rms_norm_fn(x.device)(x, residual, self.weight, self.eps)
        return get_rms_norm_fn(x.device)(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        """Set the scale to ones."""
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


# Every norm class xtl's models build (Fp32ScaleRMSNorm is an RMSNorm, the vision tower's LayerNorm an
# nn.LayerNorm): code that treats norm weights apart (no weight decay) recognizes them by these types.
NORM_TYPES: tuple[type[nn.Module], ...] = (RMSNorm, nn.LayerNorm)
