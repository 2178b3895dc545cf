"""Gathering token rows per expert and combining expert outputs per token, behind two selectors.

Both ops are plain functions of tensors so that every dispatcher (the single-rank one and an expert-parallel
all-to-all one) reuses them. Rows are ordered by expert; ``row_order`` gives, for each row, its position in the
flattened slot-major ``(k, N)`` assignment list, and ``topk_ids`` ``(N, k)`` is the routing decision.

- :func:`get_moe_gather_fn`: :func:`gather_expert_rows` (one index op) or, under ``XTL_HF_IMPL``,
  :func:`gather_expert_rows_hf` (one index op per expert, as transformers' eager expert loop; the backward then
  accumulates the input gradient expert by expert, as transformers does).
- :func:`get_moe_combine_fn`: :func:`combine_expert_rows` (the k weighted rows of a token summed in fp32, one
  deterministic reduction) or, under ``XTL_HF_IMPL``, :func:`combine_expert_rows_hf` (weighted rows cast to the
  model dtype and added in ascending expert order in that dtype, transformers' eager loop forward and backward).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xtl.ops.selector import hf_impl_enabled

GatherFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
CombineFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def get_moe_gather_fn() -> GatherFn:
    """Return ``fn(hidden_states, token_idx, tokens_per_expert) -> rows`` that gathers token rows by expert.

    :func:`gather_expert_rows_hf` under ``XTL_HF_IMPL``, else :func:`gather_expert_rows`.
    """
    return gather_expert_rows_hf if hf_impl_enabled() else gather_expert_rows


def get_moe_combine_fn() -> CombineFn:
    """Return ``fn(expert_out, row_weights, row_order, topk_ids) -> out`` that sums each token's weighted rows.

    :func:`combine_expert_rows_hf` under ``XTL_HF_IMPL``, else :func:`combine_expert_rows`.
    """
    return combine_expert_rows_hf if hf_impl_enabled() else combine_expert_rows


def gather_expert_rows(
    hidden_states: torch.Tensor, token_idx: torch.Tensor, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """Rows ``(M, C)`` ``hidden_states[token_idx]`` in one index op.

    Arguments as :func:`gather_expert_rows_hf` (``tokens_per_expert`` is unused).
    """
    return hidden_states[token_idx]


def gather_expert_rows_hf(
    hidden_states: torch.Tensor, token_idx: torch.Tensor, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """Rows ``(M, C)`` ``hidden_states[token_idx]``, one index op per expert with rows (one host sync).

    Args:
        hidden_states: ``(N, C)`` token rows.
        token_idx: ``(M,)`` token of each row, rows grouped by expert.
        tokens_per_expert: ``(E,)`` row count of each expert.
    """
    bounds = [0, *torch.cumsum(tokens_per_expert, 0).tolist()]
    parts = [hidden_states[token_idx[s:e]] for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    if len(parts) > 1:
        return torch.cat(parts)
    return parts[0] if parts else hidden_states[token_idx]


def combine_expert_rows(
    expert_out: torch.Tensor, row_weights: torch.Tensor, row_order: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Weighted sum per token ``(N, C)`` of the expert rows ``(M, C)``, accumulated in fp32.

    Args:
        expert_out: ``(M, C)`` expert outputs, rows grouped by expert.
        row_weights: ``(M,)`` combine weight of each row.
        row_order: ``(M,)`` slot-major ``(k, N)`` position of each row.
        topk_ids: ``(N, k)`` the routing decision.
    """
    weighted = expert_out.float() * row_weights[:, None].float()
    return _by_slot(weighted, row_order, topk_ids).sum(0).to(expert_out.dtype)


def combine_expert_rows_hf(
    expert_out: torch.Tensor, row_weights: torch.Tensor, row_order: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Weighted sum per token ``(N, C)`` of the expert rows ``(M, C)`` in transformers' order and dtype.

    Each row times its weight is cast to the dtype of ``expert_out``; a token's k rows are added to zeros in
    ascending expert order in that dtype.

    Args:
        expert_out: ``(M, C)`` expert outputs, rows grouped by expert.
        row_weights: ``(M,)`` combine weight of each row.
        row_order: ``(M,)`` slot-major ``(k, N)`` position of each row.
        topk_ids: ``(N, k)`` the routing decision.
    """
    num_tokens, top_k = topk_ids.shape
    slots = _by_slot((expert_out * row_weights[:, None]).to(expert_out.dtype), row_order, topk_ids)
    rank = topk_ids.argsort(dim=1, stable=True)
    tokens = torch.arange(num_tokens, device=expert_out.device)
    out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=expert_out.dtype, device=expert_out.device)
    for j in range(top_k):
        out = out + slots[rank[:, j], tokens]
    return out


def _by_slot(weighted: torch.Tensor, row_order: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``(k, N, C)`` the weighted rows put back at their top-k slot of their token."""
    num_tokens, top_k = topk_ids.shape
    slots = torch.empty_like(weighted)
    slots[row_order] = weighted
    return slots.view(top_k, num_tokens, weighted.shape[-1])
