"""Ulysses sequence-parallel attention: a context-parallel group attends a packed sequence split across its ranks.

Each of the ``cp`` ranks holds ``T / cp`` consecutive tokens of one packed ``(1, T)`` sequence (its queries, keys and
values for every head). Before attention an all-to-all trades heads for tokens: every rank then holds the whole
sequence for ``H / cp`` of the heads, and runs the ordinary attention kernel with the document boundaries
(``cu_seq_lens``) of the whole pack, so documents that cross a split point attend exactly as on one device. After
attention the inverse all-to-all gives every rank its own tokens back, for all heads. Both exchanges are
differentiable (backward runs the opposite all-to-all).

Grouped-query attention needs ``cp`` to divide the key/value heads as well: with fewer key/value heads than that,
they are repeated first (the smallest factor that makes their count a multiple of ``cp``), so each rank's query
heads meet their own key/value heads. The query heads must be divisible by ``cp``; where they are not,
:class:`ContextParallelAttention` attends through :class:`~xtl.ops.allgather_kv.AllGatherKVAttention` instead.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from xtl.ops.allgather_kv import AllGatherKVAttention
from xtl.ops.attention import AttentionMaskSpec, AttnFn, get_attn_impl_fn, repeat_kv


def ulysses_kv_repeats(num_heads: int, num_kv_heads: int, cp: int) -> int:
    """How often each key/value head is repeated so that ``cp`` ranks can split the heads evenly.

    Raises:
        ValueError: ``cp`` does not divide the query heads.
    """
    if num_heads % cp:
        raise ValueError(
            f"Ulysses attention splits the {num_heads} query heads over the context-parallel size {cp}; choose a "
            f"size that divides {num_heads}"
        )
    return cp // math.gcd(num_kv_heads, cp)


class ContextParallelAttention:
    """Mixin of an attention module: its kernel, wrapped for context parallelism once the module belongs to a
    context-parallel group (:meth:`use_context_parallel`, called by the strategy on ``model.attention_modules()``).

    The method: Ulysses (:class:`UlyssesAttention`) when the group's size divides the query heads, else all-gather-KV
    (:class:`~xtl.ops.allgather_kv.AllGatherKVAttention`). The module sets ``attn_impl``, ``num_heads`` and
    ``num_kv_heads`` (the key/value heads its kernel receives).
    """

    attn_impl: str
    num_heads: int
    num_kv_heads: int
    context_group: dist.ProcessGroup | None = None
    context_parallel_method: str | None = None  # ``ulysses``, ``allgather_kv``; ``None`` outside a group

    def use_context_parallel(self, group: dist.ProcessGroup) -> None:
        """Attend the whole sequence of ``group``'s ranks from now on, by the method its size allows."""
        self.context_group = group
        self.context_parallel_method = "allgather_kv" if self.num_heads % dist.get_world_size(group) else "ulysses"

    def attention_fn(self) -> AttnFn:
        """The kernel this module attends with (:func:`~xtl.ops.attention.get_attn_impl_fn` of ``attn_impl``,
        resolved per call so the HF-parity selector applies live), wrapped by the context-parallel method."""
        attn = get_attn_impl_fn(self.attn_impl)
        method = self.context_parallel_method
        if method is None:
            return attn
        if method == "allgather_kv":
            return AllGatherKVAttention(self.context_group)
        return UlyssesAttention(attn, self.context_group)


class UlyssesAttention:
    """An attention function (``q (B, H, T/cp, D)``, ``k``/``v`` ``(B, Hkv, T/cp, D)`` -> ``(B, T/cp, H, D)``) that
    attends the whole sequence of a context-parallel group by exchanging heads for tokens.

    Args:
        attn_fn: The attention kernel run on the whole sequence (any of :func:`xtl.ops.attention.get_attn_impl_fn`).
        group: The context-parallel process group (rank ``r`` holds tokens ``[r * T/cp, (r + 1) * T/cp)``).
    """

    def __init__(self, attn_fn: AttnFn, group: dist.ProcessGroup) -> None:
        self.attn_fn = attn_fn
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
        """Attend this rank's tokens against the whole sequence; ``mask`` describes the whole packed sequence."""
        repeats = ulysses_kv_repeats(q.shape[1], k.shape[1], self.cp)
        k, v = repeat_kv(k, repeats), repeat_kv(v, repeats)
        q, k, v = (self._heads_for_tokens(x) for x in (q, k, v))
        if sinks is not None:
            heads = sinks.shape[0] // self.cp
            sinks = sinks[self.rank * heads : (self.rank + 1) * heads]
        out = self.attn_fn(q, k, v, mask, scaling, dropout, sinks)
        return self._tokens_for_heads(out)

    def _heads_for_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, H, T/cp, D)`` holding all heads of this rank's tokens -> ``(B, H/cp, T, D)``: this rank's heads, all
        tokens (in rank order)."""
        batch, heads, tokens, dim = x.shape
        chunks = x.reshape(batch, self.cp, heads // self.cp, tokens, dim).transpose(0, 1).contiguous()
        received = self._all_to_all(chunks)  # [j]: rank j's tokens of this rank's heads
        return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.cp, self.cp * tokens, dim)

    def _tokens_for_heads(self, out: torch.Tensor) -> torch.Tensor:
        """``(B, T, H/cp, D)``: this rank's heads, all tokens -> ``(B, T/cp, H, D)``: all heads of its tokens."""
        batch, tokens, heads, dim = out.shape
        chunks = out.reshape(batch, self.cp, tokens // self.cp, heads, dim).transpose(0, 1).contiguous()
        received = self._all_to_all(chunks)  # [j]: rank j's heads of this rank's tokens
        return received.permute(1, 2, 0, 3, 4).reshape(batch, tokens // self.cp, self.cp * heads, dim)

    def _all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        """Send ``chunks[j]`` to rank ``j``; return what each rank sent here, stacked by source rank."""
        return wait_tensor(all_to_all_single_autograd(chunks, None, None, self.group))
