"""Token dispatch and combine between tokens and experts.

A dispatcher turns routed tokens into rows grouped by (local) expert for the grouped GEMM, and turns the
expert outputs back into one weighted sum per token. :class:`LocalDispatcher` is the single-rank implementation;
an expert-parallel dispatcher (all-to-all over the expert mesh axis) implements the same two methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from xtl.utils import hf_impl_enabled


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

    ``combine`` multiplies each row by its weight, casts to the rows' dtype and sums the k rows of a token in fp32
    (one deterministic reduction). Under ``XTL_HF_IMPL`` it instead gathers per expert and adds the k weighted rows
    in ascending expert order in the model dtype, which is transformers' eager expert loop, forward and backward.
    """

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        """Group ``hidden_states`` ``(N, C)`` by the experts in ``topk_ids`` ``(N, k)``."""
        num_tokens = topk_ids.shape[0]
        flat_ids = topk_ids.t().reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_idx = order % num_tokens
        tokens_per_expert = torch.bincount(flat_ids, minlength=self.num_experts)
        if hf_impl_enabled():
            bounds = [0, *torch.cumsum(tokens_per_expert, 0).tolist()]
            parts = [hidden_states[token_idx[s:e]] for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
            rows = torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else hidden_states[token_idx])
        else:
            rows = hidden_states[token_idx]
        weights = topk_weights.t().reshape(-1)[order]
        return Dispatched(rows, tokens_per_expert, weights, order, topk_ids)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Weighted sum per token ``(N, C)`` of the expert outputs ``(M, C)``."""
        num_tokens, top_k = dispatched.topk_ids.shape
        hf = hf_impl_enabled()
        if hf:
            weighted = (expert_out * dispatched.row_weights[:, None]).to(expert_out.dtype)
        else:
            weighted = expert_out.float() * dispatched.row_weights[:, None].float()
        slots = torch.empty_like(weighted)
        slots[dispatched.row_order] = weighted
        slots = slots.view(top_k, num_tokens, -1)
        if not hf:
            return slots.sum(0).to(expert_out.dtype)
        rank = dispatched.topk_ids.argsort(dim=1, stable=True)
        tokens = torch.arange(num_tokens, device=expert_out.device)
        out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=expert_out.dtype, device=expert_out.device)
        for j in range(top_k):
            out = out + slots[rank[:, j], tokens]
        return out
