"""Pre-norm transformer decoder layer."""

from __future__ import annotations

import torch
from torch import nn

from xtl.module.kv_cache import NO_LAYER_KV_CACHE, LayerKVCache
from xtl.module.norm import RMSNorm
from xtl.ops.attention import AttentionMaskSpec


class DecoderLayer(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    The residual add after attention and the post-attention norm are one call of that norm, ``norm(h, residual)``
    (one fused kernel on CUDA; elsewhere, and in HF-parity mode, the same ops as the add followed by the norm).

    Args:
        self_attn: Attention module called as ``self_attn(h, position_embeddings, mask, kv_cache)``.
        mlp: Feed-forward module called as ``mlp(h)``.
        hidden_size: Model width.
        rms_norm_eps: Epsilon of both norms.
        norm_class: The RMSNorm variant of both norms, built as ``norm_class(hidden_size, rms_norm_eps)``.
    """

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        hidden_size: int,
        rms_norm_eps: float,
        norm_class: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm_class(hidden_size, rms_norm_eps)
        self.post_attention_layernorm = norm_class(hidden_size, rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMaskSpec,
        kv_cache: LayerKVCache = NO_LAYER_KV_CACHE,
    ) -> torch.Tensor:
        """Run the layer on ``(B, T, C)`` hidden states (``kv_cache``: this layer's cache, when decoding)."""
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, mask, kv_cache)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return residual + self.mlp(hidden_states)
