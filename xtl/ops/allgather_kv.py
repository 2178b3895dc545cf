"""All-gather-KV context-parallel attention: the method for head counts the context-parallel size does not divide.

Each of the ``cp`` ranks holds ``T / cp`` consecutive tokens of one packed ``(1, T)`` sequence. Keys and values are
all-gathered along the sequence (every rank then holds them for the whole pack, all key/value heads); each rank
attends its own queries, at offset ``rank * T / cp`` of the pack, against them under the pack's document, causal
and sliding-window mask, in the eager formulation (fp32 softmax, optional sinks). Backward reduce-scatters the key
and value gradients back to their ranks.

It keeps ``T x Hkv`` key/value elements and a ``(T / cp) x T`` score matrix per head on every rank, so it saves less
memory than Ulysses (:mod:`xtl.ops.ulysses`, which :class:`~xtl.ops.ulysses.ContextParallelAttention` prefers
whenever ``cp`` divides the query heads) and is chosen only where Ulysses cannot split the heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_tensor_autograd, wait_tensor

from xtl.ops.attention import AttentionMaskSpec, attention_probs, repeat_kv


class AllGatherKVAttention:
    """An attention function (``q (B, H, T/cp, D)``, ``k``/``v`` ``(B, Hkv, T/cp, D)`` -> ``(B, T/cp, H, D)``) that
    attends this rank's queries against the keys and values of the whole sequence of its context-parallel group.

    Args:
        group: The context-parallel process group (rank ``r`` holds tokens ``[r * T/cp, (r + 1) * T/cp)``).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: AttentionMaskSpec,
        scaling: float,
        dropout: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend this rank's queries; ``mask`` describes the whole packed sequence."""
        keys = repeat_kv(self._gather(k), q.shape[1] // k.shape[1])
        values = repeat_kv(self._gather(v), q.shape[1] // v.shape[1])
        scores = torch.matmul(q, keys.transpose(2, 3)) * scaling
        allowed = self.local_mask(mask, q.shape[2], keys.shape[2], q.device)
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = attention_probs(scores, q.dtype, dropout, sinks)
        return torch.matmul(probs, values).transpose(1, 2).contiguous()

    def local_mask(self, mask: AttentionMaskSpec, local: int, total: int, device: torch.device) -> torch.Tensor:
        """``(local, total)`` boolean: query ``offset + i`` may see key ``j`` (same document, causal, window)."""
        keys = torch.arange(total, device=device)
        queries = keys[self.rank * local : (self.rank + 1) * local, None]
        allowed = keys <= queries
        if mask.sliding_window is not None:
            allowed = allowed & (keys > queries - mask.sliding_window)
        if mask.cu_seq_lens is not None:
            lengths = (mask.cu_seq_lens[1:] - mask.cu_seq_lens[:-1]).long().to(device)
            doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=total)
            allowed = allowed & (doc[queries] == doc[None, :])
        return allowed

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, Hkv, T/cp, D)`` of every rank, concatenated along the sequence in rank order."""
        return wait_tensor(all_gather_tensor_autograd(x.contiguous(), 2, self.group))
