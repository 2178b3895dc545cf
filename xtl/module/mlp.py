"""Gated feed-forward blocks."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` — SwiGLU with ``hidden_act='silu'``."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` ``(..., hidden)``."""
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
