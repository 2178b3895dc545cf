"""Routed experts stored as grouped parameters with a leading expert dimension (expert parallelism shards dim 0).

Layout of every family: ``gate_up`` ``(E, 2I, C)`` = the gate rows then the up rows of each expert (the layout of
``nn.Linear`` weights), ``down`` ``(E, C, I)``. Checkpoints with another layout are converted by the model's
``hf_to_param`` / ``param_to_hf`` hooks, never here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.activations import ACT2FN

from xtl.ops.expert_layout import deinterleave_gate_up, get_gate_up_layout, interleave_gate_up, split_concat
from xtl.ops.grouped_gemm import get_grouped_gemm_fn

__all__ = [
    "ClampedSwiGLUExperts",
    "GroupedExperts",
    "deinterleave_gate_up",
    "interleave_gate_up",
    "local_experts",
]


class GroupedExperts(nn.Module):
    """E gated-MLP experts ``down(act(gate(x)) * up(x))`` run as two grouped GEMMs.

    Args:
        num_experts: Experts held by this module (all experts, or this rank's slice under expert parallelism).
        hidden_size: Model width C.
        intermediate_size: Expert width I.
        hidden_act: Activation of the gate.
        gemm_impl: Grouped GEMM implementation (see :func:`xtl.ops.get_grouped_gemm_fn`).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str = "silu",
        gemm_impl: str = "auto",
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gemm_impl = gemm_impl
        self.act_fn = ACT2FN[hidden_act]
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Run rows ``(M, C)`` grouped by expert (``tokens_per_expert`` ``(E,)``); returns ``(M, C)``."""
        gemm = get_grouped_gemm_fn(self.gemm_impl)
        gate_up = gemm(hidden_states, local_experts(self.gate_up).transpose(1, 2), tokens_per_expert)
        return gemm(self.activation(gate_up), local_experts(self.down).transpose(1, 2), tokens_per_expert)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of the concatenated ``(M, 2I)`` projection."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


class ClampedSwiGLUExperts(GroupedExperts):
    """GPT-OSS experts: biased projections and a clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``.

    ``gate`` is clamped above at ``limit``, ``up`` to ``[-limit, limit]``. Biases: ``gate_up_bias`` ``(E, 2I)``
    (gate then up), ``down_bias`` ``(E, C)``.

    The weights reach the grouped GEMM in the layout :func:`xtl.ops.get_gate_up_layout` selects: views of the
    stored parameters, or (for the HF-parity selectors) transformers' own layout (``(E, C, 2I)`` with gate/up
    interleaved, ``(E, I, C)``) as contiguous copies, so each matmul is the very BLAS call transformers makes.

    Args:
        num_experts: Experts held by this module.
        hidden_size: Model width.
        intermediate_size: Expert width.
        alpha: Sigmoid gain.
        limit: Clamp bound.
        gemm_impl: Grouped GEMM implementation.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        alpha: float = 1.702,
        limit: float = 7.0,
        gemm_impl: str = "auto",
    ) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, "silu", gemm_impl)
        self.alpha = alpha
        self.limit = limit
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Run rows ``(M, C)`` grouped by expert; returns ``(M, C)``."""
        gemm = get_grouped_gemm_fn(self.gemm_impl)
        counts = tokens_per_expert.to(hidden_states.device)
        layout = get_gate_up_layout()
        w1, b1, w2 = layout.operands(
            local_experts(self.gate_up), local_experts(self.gate_up_bias), local_experts(self.down)
        )
        gate_up = layout.add_bias(gemm(hidden_states, w1, counts), b1, counts)
        out = gemm(self.clamped_swiglu(gate_up, layout.split), w2, counts)
        return layout.add_bias(out, local_experts(self.down_bias), counts)

    def clamped_swiglu(
        self,
        gate_up: torch.Tensor,
        split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = split_concat,
    ) -> torch.Tensor:
        """The clamped SwiGLU of ``(M, 2I)`` gate/up columns, split into gate and up by ``split``."""
        gate, up = split(gate_up)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def local_experts(param: torch.Tensor) -> torch.Tensor:
    """The experts of ``param`` this rank computes with.

    Under expert parallelism a grouped parameter is a ``DTensor`` split on its expert dimension over the
    expert-parallel ranks, and the dispatcher delivers rows for the local experts only: the local shard is the
    operand. Otherwise the parameter itself.
    """
    return param.to_local() if isinstance(param, DTensor) else param
