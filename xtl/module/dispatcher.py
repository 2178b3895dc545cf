"""Token dispatch and combine between tokens and experts.

A dispatcher turns routed tokens into rows grouped by (local) expert for the grouped GEMM, and turns the
expert outputs back into one weighted sum per token. :class:`LocalDispatcher` is the single-rank implementation;
an expert-parallel dispatcher (all-to-all over the expert mesh axis) implements the same two methods and reuses
the gather and combine ops of :mod:`xtl.ops.moe_dispatch` around its exchange.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from xtl.ops.moe_dispatch import get_moe_combine_fn, get_moe_gather_fn


@dataclass
class Dispatched:
    """Tokens grouped by expert, plus what :meth:`MoEDispatcher.combine` needs to undo it.

    Attributes:
        hidden_states: ``(M, C)`` rows grouped by local expert (expert 0's rows first).
        tokens_per_expert: ``(E_local,)`` int64 row count of each local expert.
        row_weights: ``(M,)`` combine weight of each row.
        row_order: ``(M,)`` position of each row in the flattened ``(k, N)`` (slot-major) assignment list.
        topk_ids: ``(N, k)`` the routing decision.
    """

    hidden_states: torch.Tensor
    tokens_per_expert: torch.Tensor
    row_weights: torch.Tensor
    row_order: torch.Tensor
    topk_ids: torch.Tensor


class MoEDispatcher(ABC):
    """Moves token rows to the experts that were chosen for them and back.

    Args:
        num_experts: Routed experts of the layer (all ranks together).
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    @abstractmethod
    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        """Group ``hidden_states`` ``(N, C)`` by the experts in ``topk_ids`` ``(N, k)``."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Weighted sum per token ``(N, C)`` of the expert outputs ``(M, C)`` (rows as in ``dispatched``)."""


class LocalDispatcher(MoEDispatcher):
    """All experts on this rank. Rows are ordered by expert, then top-k slot, then token (transformers' order).

    Rows are gathered by :func:`xtl.ops.get_moe_gather_fn` and combined by :func:`xtl.ops.get_moe_combine_fn`:
    by default each row is weighted and the k rows of a token are summed in fp32 (one deterministic reduction);
    the HF-parity selectors gather per expert and add the k weighted rows in ascending expert order in the model
    dtype, which is transformers' eager expert loop, forward and backward.
    """

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        """Group ``hidden_states`` ``(N, C)`` by the experts in ``topk_ids`` ``(N, k)``."""
        num_tokens = topk_ids.shape[0]
        flat_ids = topk_ids.t().reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_idx = order % num_tokens
        tokens_per_expert = torch.bincount(flat_ids, minlength=self.num_experts)
        rows = get_moe_gather_fn()(hidden_states, token_idx, tokens_per_expert)
        weights = topk_weights.t().reshape(-1)[order]
        return Dispatched(rows, tokens_per_expert, weights, order, topk_ids)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Weighted sum per token ``(N, C)`` of the expert outputs ``(M, C)``."""
        combine = get_moe_combine_fn()
        return combine(expert_out, dispatched.row_weights, dispatched.row_order, dispatched.topk_ids)
