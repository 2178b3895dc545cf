"""The per-token log-probability scorer every objective and evaluation shares, context-parallel aware.

:func:`score_tokens` runs a model on a packed micro-batch (or this rank's context-parallel share of one) with the LM
head on the scored positions only, and returns each scored token's log-probability under the model (at a sampling
temperature), optionally its entropy and whether it is the greedy choice. Supervised fine-tuning's held-out metrics,
the preference objectives (DPO family, KTO), GRPO (old, reference and policy log-probabilities) and lm-eval requests
all read their log-probabilities here.

Under context parallelism each rank scores the positions of its own share. What an objective needs of the whole pack
is made whole over the context-parallel group by :func:`document_sums` (per-document sums: a response's
log-probability) and :func:`pack_values` (the values at given positions of the whole pack: a completion's tokens).
Both sum over the group differentiably: every rank then holds the whole pack's values and computes the whole
objective, and the backward pass sums every rank's gradient of them, so each share's tokens get the gradient of the
objective times the group size. An objective of whole-pack values therefore counts its normalizer on every rank of the
group too (the group's sums are ``cp`` times one process's and their ratios equal it), while sums of a share's own
tokens (a token-level loss) count that share's tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from xtl.batch import SequenceContext
from xtl.data.item import IGNORE_INDEX


@dataclass
class TokenScores:
    """The positions the head ran on in one packed micro-batch (this rank's share of it under context parallelism).

    Attributes:
        logps: ``(N,)`` fp32 (fp64 for an fp64 model) log-probability of each position's target (with gradient
            when the model has one); 0 where the position has no target.
        scored: ``(N,)`` bool: the position has a target (its label is not ``-100``).
        positions: ``(N,)`` the positions, in the whole pack (a share's local position plus its ``share_start``),
            increasing.
        entropy: ``(N,)`` the entropy of each position's distribution (no gradient; 0 where not scored), when asked.
        greedy: ``(N,)`` bool, the target is the most likely token (False where not scored), when asked.
        extras: The model output's family extras (router statistics, ...), for the objective's extra losses.
    """

    logps: torch.Tensor
    scored: torch.Tensor
    positions: torch.Tensor
    entropy: torch.Tensor | None = None
    greedy: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def score_tokens(
    model: torch.nn.Module,
    seq_ctx: SequenceContext,
    labels: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    greedy: bool = False,
) -> TokenScores:
    """Log-probabilities of the targets of a packed micro-batch under ``model``.

    The head runs on the positions ``seq_ctx.loss_positions`` names (the supervised ones, topped up to few distinct
    counts by the collate step), or on every position without them; the vocabulary-wide logits of no other position
    are computed. Per position the math is ``log_softmax(fp32 logits / temperature)[target]``, which at temperature
    1 is exactly the negated per-token cross-entropy (``F.cross_entropy(..., reduction="none")``). Nothing is read back
    from the device.

    Args:
        model: An xtl model (any family; sharded or not; its attention modules in their context-parallel group when
            ``seq_ctx`` is a share).
        seq_ctx: The packed batch, or this rank's share of it.
        labels: ``(1, T)`` shifted targets of ``seq_ctx``'s positions, ``-100`` where nothing is scored.
        temperature: Logits are divided by it (a sampling temperature: RL's log-probabilities of sampled tokens).
        entropy: Also return each position's entropy (detached).
        greedy: Also return whether each target is the argmax.

    Returns:
        TokenScores: The head's positions of ``seq_ctx``.
    """
    targets = labels[0]
    head = seq_ctx.loss_positions
    if head is None:
        out = model(seq_ctx=seq_ctx, return_logits=True)
        head = torch.arange(targets.numel(), device=targets.device)
    else:
        head = head.to(targets.device)
        out = model(seq_ctx=seq_ctx, return_logits=True, logits_to_keep=head)
        targets = targets.index_select(0, head)
    logits = out.logits[0]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, or fp64 for an fp64 model
    if temperature != 1.0:
        logits = logits / temperature
    scored = targets != IGNORE_INDEX
    logprobs = torch.log_softmax(logits, dim=-1)
    picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    scores = TokenScores(torch.where(scored, picked, 0.0), scored, head + seq_ctx.share_start, extras=out.extras)
    if entropy:
        detached = logprobs.detach()
        scores.entropy = torch.where(scored, -(detached.exp() * detached).sum(-1), 0.0)
    if greedy:
        scores.greedy = (logprobs.detach().argmax(-1) == targets) & scored
    return scores


def document_sums(
    values: torch.Tensor,
    positions: torch.Tensor,
    seq_ctx: SequenceContext,
    num_docs: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-document sums of values at whole-pack ``positions``, over the whole pack.

    Args:
        values: ``(N,)`` values (e.g. :attr:`TokenScores.logps`), with or without gradient.
        positions: ``(N,)`` their whole-pack positions.
        seq_ctx: The pack (or a share of it: its document bounds are the whole pack's).
        num_docs: Documents to return (the first ``num_docs``; positions in later ones, e.g. padding, are dropped).
        group: The context-parallel group whose shares hold the pack's other positions (``None``: the whole pack is
            here). The sums are taken over it differentiably (:func:`context_sum`).

    Returns:
        ``(num_docs,)`` sums, in ``values``' dtype.
    """
    ends = seq_ctx.cu_seq_lens[1:].to(values.device, torch.long)
    document = torch.searchsorted(ends, positions.to(values.device), right=True).clamp(max=num_docs)
    sums = torch.zeros(num_docs + 1, dtype=values.dtype, device=values.device).index_add(0, document, values)
    return context_sum(sums[:num_docs], group)


def pack_values(
    scores: TokenScores,
    wanted: torch.Tensor,
    values: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The values of the scored positions among the whole-pack positions ``wanted``, gathered from the
    context-parallel shares that hold them.

    Args:
        scores: This share's scores.
        wanted: ``(M,)`` increasing whole-pack positions, each scored by exactly one share (e.g. a packed batch's
            completion tokens).
        values: ``(N,)`` values at ``scores.positions`` (default: ``scores.logps``), e.g. ``scores.entropy``.
        group: The context-parallel group (``None``: the whole pack is here).

    Returns:
        ``(M,)`` the values at ``wanted`` (summed over the group differentiably, :func:`context_sum`).
    """
    values = scores.logps if values is None else values
    wanted = wanted.to(values.device)
    if not wanted.numel():  # nothing wanted (an update whose groups were all dropped): still part of the graph
        return context_sum(values[:0], group)
    index = torch.searchsorted(wanted, scores.positions).clamp(max=wanted.numel() - 1)
    keep = scores.scored & (wanted.index_select(0, index) == scores.positions)
    whole = torch.zeros(wanted.numel(), dtype=values.dtype, device=values.device)
    whole = whole.index_add(0, index, torch.where(keep, values, 0.0))
    return context_sum(whole, group)


def context_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``tensor`` summed over ``group``'s ranks, differentiably: the gradient of each rank's input is the sum of
    every rank's output gradient (``tensor`` itself without a group)."""
    if group is None:
        return tensor
    if not tensor.requires_grad:
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out
    return _AllReduceSum.apply(tensor, group)


class _AllReduceSum(torch.autograd.Function):
    """Sum over a process group; the gradient of each rank's input is the sum of every rank's output gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
