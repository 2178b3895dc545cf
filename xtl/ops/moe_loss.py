"""MoE router statistics and the auxiliary losses built from them.

The model returns *sums and counts* per MoE layer (see :func:`router_statistics`); the losses are formed from
them by :func:`balance_loss` and :func:`z_loss`, possibly after the training module has all-reduced the counts
across data-parallel ranks and micro-batches, so that the losses are normalized by the global token count exactly
like the cross-entropy loss.
"""

from __future__ import annotations

import torch


@torch.compiler.disable  # eager under a compiled forward: the counted tokens' number follows the data (padding)
def router_statistics(
    logits: torch.Tensor, probs: torch.Tensor, topk_ids: torch.Tensor, token_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-layer sums over the counted tokens of one router call.

    Args:
        logits: ``(N, E)`` raw router logits.
        probs: ``(N, E)`` per-expert probabilities (rows sum to 1).
        topk_ids: ``(N, k)`` selected experts.
        token_mask: ``(N,)`` bool, False for padding tokens that must not count (``None``: all count).

    Returns:
        ``(prob_sum (E,) fp32, z_sum () fp32, tokens_per_expert (E,) int64)``: the sum of ``probs`` over tokens,
        the sum of ``logsumexp(logits)**2`` over tokens (both differentiable) and the number of (token, slot)
        assignments per expert (no gradient).
    """
    num_experts = probs.shape[-1]
    probs, logits = probs.float(), logits.float()
    ids = topk_ids
    if token_mask is not None:
        probs, logits, ids = probs[token_mask], logits[token_mask], topk_ids[token_mask]
    prob_sum = probs.sum(0)
    z_sum = torch.logsumexp(logits, dim=-1).square().sum()
    tokens_per_expert = torch.bincount(ids.reshape(-1), minlength=num_experts).to(torch.int64)
    return prob_sum, z_sum, tokens_per_expert.detach()


def balance_loss(
    prob_sum: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: torch.Tensor | int
) -> torch.Tensor:
    """Switch-style load-balancing loss, averaged over layers.

    ``loss = mean_l  E * sum_e (tokens_per_expert[l, e] / N) * (prob_sum[l, e] / N)`` (transformers' scaling: a
    perfectly balanced router gives ``k``, the number of experts per token). Pass global (all-reduced)
    ``tokens_per_expert`` and ``num_tokens`` with a local ``prob_sum``: the sum of the results over ranks and
    micro-batches is then the loss of the global batch.

    Args:
        prob_sum: ``(L, E)`` summed router probabilities.
        tokens_per_expert: ``(L, E)`` assignment counts.
        num_tokens: Number of counted tokens N.
    """
    num_experts = prob_sum.shape[-1]
    n = torch.as_tensor(num_tokens, dtype=torch.float32, device=prob_sum.device).clamp(min=1)
    per_layer = num_experts * ((tokens_per_expert.float() / n) * (prob_sum.float() / n)).sum(-1)
    return per_layer.mean()


def z_loss(z_sum: torch.Tensor, num_tokens: torch.Tensor | int) -> torch.Tensor:
    """Router z-loss ``mean_l (sum_t logsumexp(logits_t)**2) / N`` from ``z_sum (L,)`` and the (global) count N."""
    n = torch.as_tensor(num_tokens, dtype=torch.float32, device=z_sum.device).clamp(min=1)
    return (z_sum.float() / n).mean()
