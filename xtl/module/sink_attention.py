"""Attention with learned per-head sink logits (GPT-OSS)."""

from __future__ import annotations

import torch
from torch import nn

from xtl.module.attention import MultiHeadAttention
from xtl.ops.attention import AttentionMaskSpec, get_attn_impl_fn
from xtl.ops.rope import apply_rotary_pos_emb


class SinkAttention(MultiHeadAttention):
    """:class:`MultiHeadAttention` plus ``sinks`` ``(H,)``: an extra logit per head that joins the softmax and is
    then dropped, so a query may attend to "nothing". Takes the same arguments as :class:`MultiHeadAttention`.
    """

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - forwarded unchanged
        super().__init__(*args, **kwargs)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMaskSpec,
    ) -> torch.Tensor:
        """Attend ``hidden_states`` ``(B, T, C)`` under ``mask``; returns ``(B, T, C)``."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)
        k = self.k_proj(hidden_states).view(hidden_shape)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        attn = get_attn_impl_fn(self.attn_impl)
        dropout = self.dropout if self.training else 0.0
        out = attn(q, k, v, mask.with_window(self.sliding_window), self.scaling, dropout, sinks=self.sinks)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous())
