"""Attention with learned per-head sink logits (GPT-OSS)."""

from __future__ import annotations

import torch
from torch import nn

from xtl.module.attention import MultiHeadAttention
from xtl.ops.attention import AttentionMaskSpec


class SinkAttention(MultiHeadAttention):
    """:class:`MultiHeadAttention` plus ``sinks`` ``(H,)``: an extra logit per head that joins the softmax and is
    then dropped, so a query may attend to "nothing". Takes the same arguments as :class:`MultiHeadAttention`.
    """

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - forwarded unchanged
        super().__init__(*args, **kwargs)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMaskSpec) -> torch.Tensor:
        """The attention core with this layer's sink logits."""
        attn = self.attention_fn()
        return attn(q, k, v, mask, self.scaling, self.dropout if self.training else 0.0, sinks=self.sinks)
