"""How biased gate/up expert weights are presented to the grouped GEMM, behind one selector.

xtl stores ``gate_up`` ``(E, 2I, C)`` as the gate rows then the up rows of each expert, its bias ``(E, 2I)`` the
same way, and ``down`` ``(E, C, I)``. A :class:`GateUpLayout` turns these parameters into the ``(E, C, 2I)`` /
``(E, 2I)`` / ``(E, I, C)`` operands of the grouped GEMM and says how to split the ``(M, 2I)`` projection into
gate and up.

- :data:`GATE_UP_CONCAT`: transposed views of the stored parameters (no copy); gate then up columns.
- :data:`GATE_UP_INTERLEAVED`: transformers' GPT-OSS layout, ``[g0, u0, g1, u1, ...]`` columns, as contiguous
  copies, so each per-expert matmul is the very BLAS call transformers makes.

``XTL_HF_IMPL=1`` makes :func:`get_gate_up_layout` return :data:`GATE_UP_INTERLEAVED`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from xtl.ops.selector import hf_impl_enabled


class GateUpLayout(NamedTuple):
    """A presentation of gate/up expert weights and the matching split of the projection.

    Attributes:
        operands: ``fn(gate_up, gate_up_bias, down) -> (w1, b1, w2)``: ``w1`` ``(E, C, 2I)``, ``b1`` ``(E, 2I)``
            and ``w2`` ``(E, I, C)`` for ``gemm(gemm(x, w1) + b1 -> act, w2)``.
        split: ``fn(gate_up_out) -> (gate, up)`` of the ``(..., 2I)`` projection, each ``(..., I)``.
        add_bias: ``fn(rows, bias, tokens_per_expert) -> rows + bias[expert of each row]`` for rows grouped by
            expert (``bias`` ``(E, N)``, ``rows`` ``(M, N)``).
    """

    operands: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    add_bias: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def get_gate_up_layout() -> GateUpLayout:
    """Return the gate/up layout for biased experts (GPT-OSS).

    :data:`GATE_UP_INTERLEAVED` under ``XTL_HF_IMPL``, else :data:`GATE_UP_CONCAT`.
    """
    return GATE_UP_INTERLEAVED if hf_impl_enabled() else GATE_UP_CONCAT


def concat_operands(
    gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped GEMM operands as transposed views of the stored (gate then up) parameters."""
    return gate_up.transpose(1, 2), gate_up_bias, down.transpose(1, 2)


def interleaved_operands(
    gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped GEMM operands in transformers' GPT-OSS layout (gate/up interleaved), as contiguous copies."""
    w1 = interleave_gate_up(gate_up, dim=1).transpose(1, 2).contiguous()
    return w1, interleave_gate_up(gate_up_bias, dim=1), down.transpose(1, 2).contiguous()


def add_bias_repeated(rows: torch.Tensor, bias: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``rows + bias`` with the bias repeated per row in one op (one segment reduction in backward)."""
    return rows + torch.repeat_interleave(bias, tokens_per_expert, dim=0)


def add_bias_per_expert(rows: torch.Tensor, bias: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``rows + bias`` expert by expert, a broadcast add per expert with rows, as transformers' eager expert loop
    does (so the bias gradient is the same per-expert column sum, bitwise; one host sync for the counts)."""
    counts = tokens_per_expert.tolist()
    parts = [chunk + bias[e] for e, chunk in enumerate(rows.split(counts)) if counts[e]]
    if not parts:
        return rows + bias[:0].sum(0)  # no rows: keep the graph connected to the bias
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def split_concat(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` of ``[gate | up]`` columns."""
    gate, up = gate_up.chunk(2, dim=-1)
    return gate, up


def split_interleaved(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` of ``[g0, u0, g1, u1, ...]`` columns."""
    return gate_up[..., ::2], gate_up[..., 1::2]


def interleave_gate_up(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """``[g0..gI-1, u0..uI-1]`` -> ``[g0, u0, g1, u1, ...]`` along ``dim``."""
    gate, up = tensor.chunk(2, dim=dim)
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def deinterleave_gate_up(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`interleave_gate_up`."""
    index = [slice(None)] * tensor.dim()
    gate_index, up_index = list(index), list(index)
    gate_index[dim], up_index[dim] = slice(0, None, 2), slice(1, None, 2)
    return torch.cat((tensor[tuple(gate_index)], tensor[tuple(up_index)]), dim=dim)


GATE_UP_CONCAT = GateUpLayout(concat_operands, split_concat, add_bias_repeated)
GATE_UP_INTERLEAVED = GateUpLayout(interleaved_operands, split_interleaved, add_bias_per_expert)
