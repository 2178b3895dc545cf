"""Token dispatch and combine between tokens and experts.

A dispatcher turns routed tokens into rows grouped by (local) expert for the grouped GEMM, and turns the
expert outputs back into one weighted sum per token. :class:`LocalDispatcher` is the single-rank implementation;
:class:`AllToAllDispatcher` (expert parallelism) implements the same two methods with the gather and combine ops
of :mod:`xtl.ops.moe_dispatch` around an all-to-all exchange over the expert-parallel group. The strategy picks the
dispatcher (``MoEBlock`` never branches on it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd, wait_tensor

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


@dataclass
class ExchangedDispatched(Dispatched):
    """:class:`Dispatched` of :class:`AllToAllDispatcher`, with what it needs to send the rows back.

    Attributes:
        send_splits: Rows this rank sent to each expert-parallel rank.
        recv_splits: Rows this rank received from each expert-parallel rank.
        local_order: ``(M_local,)`` position, in the received (source-rank-major) rows, of each row grouped by local
            expert.
    """

    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    local_order: torch.Tensor | None = None


class AllToAllDispatcher(MoEDispatcher):
    """Experts split over the ranks of an expert-parallel group: rank ``r`` holds experts ``r*E/ep .. (r+1)*E/ep-1``.

    ``dispatch`` orders this rank's (token, slot) rows by global expert as :class:`LocalDispatcher` does, exchanges
    the per-expert counts, sends each rank the rows of its experts (uneven, differentiable all-to-all; zero rows
    for an expert or a whole rank are fine) and regroups the received rows by local expert. ``combine`` undoes the
    regrouping, sends the expert outputs back, and sums each token's weighted rows with the same combine op as the
    single-rank dispatcher, so the result does not depend on where the experts live.

    Args:
        num_experts: Routed experts of the layer (all ranks together); divisible by the group size.
        group: The expert-parallel process group.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup) -> None:
        super().__init__(num_experts)
        self.group = group
        self.ep_size = dist.get_world_size(group)
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not split over {self.ep_size} expert-parallel ranks")
        self.num_local_experts = num_experts // self.ep_size

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        """Send the rows of ``hidden_states`` ``(N, C)`` to the ranks of the experts in ``topk_ids`` ``(N, k)``."""
        num_tokens = topk_ids.shape[0]
        flat_ids = topk_ids.t().reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        tokens_per_expert = torch.bincount(flat_ids, minlength=self.num_experts)
        rows = get_moe_gather_fn()(hidden_states, order % num_tokens, tokens_per_expert)
        recv_counts = wait_tensor(all_to_all_single(tokens_per_expert, None, None, self.group))
        recv_counts = recv_counts.view(self.ep_size, self.num_local_experts)  # [source rank, local expert]
        send_splits = tokens_per_expert.view(self.ep_size, self.num_local_experts).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = wait_tensor(all_to_all_single_autograd(rows, recv_splits, send_splits, self.group))
        block = torch.repeat_interleave(
            torch.arange(recv_counts.numel(), device=received.device), recv_counts.flatten().to(received.device)
        )
        source, expert = block // self.num_local_experts, block % self.num_local_experts
        local_order = torch.argsort(expert * self.ep_size + source, stable=True)
        weights = topk_weights.t().reshape(-1)[order]
        return ExchangedDispatched(
            received[local_order],
            recv_counts.sum(0),
            weights,
            order,
            topk_ids,
            send_splits=send_splits,
            recv_splits=recv_splits,
            local_order=local_order,
        )

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Send the expert outputs back and sum each token's weighted rows ``(N, C)``."""
        assert isinstance(dispatched, ExchangedDispatched)
        by_source = expert_out[torch.argsort(dispatched.local_order)]
        returned = wait_tensor(
            all_to_all_single_autograd(by_source, dispatched.send_splits, dispatched.recv_splits, self.group)
        )
        combine = get_moe_combine_fn()
        return combine(returned, dispatched.row_weights, dispatched.row_order, dispatched.topk_ids)
