"""Multi-head attention with grouped key/value heads (MHA / GQA / MQA)."""

from __future__ import annotations

import torch
from torch import nn

from xtl.module.kv_cache import NO_LAYER_KV_CACHE, LayerKVCache
from xtl.module.norm import RMSNorm
from xtl.module.traits import FusesProjections
from xtl.ops.attention import AttentionMaskSpec
from xtl.ops.fused_linear import get_fused_projection_fn
from xtl.ops.rope import get_rope_fn
from xtl.ops.ulysses import ContextParallelAttention


class MultiHeadAttention(ContextParallelAttention, FusesProjections, nn.Module):
    """GQA attention with optional per-head q/k RMSNorm (Qwen3), qkv bias (Qwen2) and a sliding window.

    Args:
        hidden_size: Model width.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (divides ``num_heads``).
        head_dim: Width of one head.
        bias: Bias on q/k/v projections.
        o_bias: Bias on the output projection.
        qk_norm: RMSNorm over each query/key head before rotary (Qwen3).
        rms_norm_eps: Epsilon of the q/k norms.
        attn_impl: ``auto``, ``eager``, ``sdpa``, ``flash`` or ``varlen`` (resolved per call: the HF-parity selectors
            apply live).
        sliding_window: Window of this layer, or ``None`` for full attention.
        dropout: Attention dropout in training.
        fused_qkv: One ``qkv_proj`` of the q, k and v rows (one matmul) instead of ``q_proj``/``k_proj``/``v_proj``;
            its HF keys are still the three projections' (see :attr:`fused_parts`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        rms_norm_eps: float = 1e-6,
        attn_impl: str = "auto",
        sliding_window: int | None = None,
        dropout: float = 0.0,
        fused_qkv: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim**-0.5
        self.attn_impl = attn_impl
        self.sliding_window = sliding_window
        self.dropout = dropout
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.fused_parts: dict[str, tuple[tuple[str, int], ...]] = {}
        if fused_qkv:
            self.qkv_proj = nn.Linear(hidden_size, q_size + 2 * kv_size, bias=bias)
            self.fused_parts = {"qkv_proj": (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size))}
        else:
            self.q_proj = nn.Linear(hidden_size, q_size, bias=bias)
            self.k_proj = nn.Linear(hidden_size, kv_size, bias=bias)
            self.v_proj = nn.Linear(hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMaskSpec,
        kv_cache: LayerKVCache = NO_LAYER_KV_CACHE,
    ) -> torch.Tensor:
        """Attend ``hidden_states`` ``(B, T, C)`` under ``mask``; returns ``(B, T, C)``.

        ``kv_cache`` stores this call's keys and values and returns every cached one to attend over.
        """
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = (t.view(hidden_shape) for t in self.project_qkv(hidden_states))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = position_embeddings
        q, k = get_rope_fn(q.device)(q, k, cos, sin)
        k, v = kv_cache.update(k, v)
        out = self.attend(q, k, v, mask.with_window(self.sliding_window))
        return self.o_proj(out.reshape(*input_shape, -1).contiguous())

    def project_qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``(B, T, heads * head_dim)`` of ``hidden_states``: three projections, or the
        fused one through :func:`xtl.ops.fused_linear.get_fused_projection_fn`."""
        if not self.fused_parts:
            return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        sizes = [size for _, size in self.fused_parts["qkv_proj"]]
        q, k, v = get_fused_projection_fn()(hidden_states, self.qkv_proj, sizes)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMaskSpec) -> torch.Tensor:
        """The attention core on rotated ``q``/``k`` and ``v``, through the selected implementation."""
        return self.attention_fn()(q, k, v, mask, self.scaling, self.dropout if self.training else 0.0)
