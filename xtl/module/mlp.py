"""Gated feed-forward blocks."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from xtl.module.traits import FusesProjections
from xtl.ops.fused_linear import get_fused_projection_fn


class GatedMLP(FusesProjections, nn.Module):
    """``down(act(gate(x)) * up(x))`` — SwiGLU with ``hidden_act='silu'``.

    Args:
        hidden_size: Model width.
        intermediate_size: Width of the gate and up projections.
        hidden_act: The gate's activation (a transformers ``ACT2FN`` name).
        bias: Bias on the three projections.
        fused_gate_up: One ``gate_up_proj`` of the gate then up rows (one matmul) instead of ``gate_proj`` and
            ``up_proj``; its HF keys are still the two projections' (see :attr:`fused_parts`).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        bias: bool = False,
        fused_gate_up: bool = False,
    ) -> None:
        super().__init__()
        self.fused_parts: dict[str, tuple[tuple[str, int], ...]] = {}
        if fused_gate_up:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
            self.fused_parts = {"gate_up_proj": (("gate_proj", intermediate_size), ("up_proj", intermediate_size))}
        else:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` ``(..., hidden)``."""
        gate, up = self.project_gate_up(x)
        return self.down_proj(self.act_fn(gate) * up)

    def project_gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and up projections of ``x``: two matmuls, or the fused one through
        :func:`xtl.ops.fused_linear.get_fused_projection_fn`."""
        if not self.fused_parts:
            return self.gate_proj(x), self.up_proj(x)
        sizes = [size for _, size in self.fused_parts["gate_up_proj"]]
        gate, up = get_fused_projection_fn()(x, self.gate_up_proj, sizes)
        return gate, up
