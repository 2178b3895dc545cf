"""Multi-head latent attention (DeepSeek-V2/V3): low-rank queries and a compressed, shared key/value latent."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xtl.module.kv_cache import NO_LAYER_KV_CACHE, LayerKVCache
from xtl.module.norm import RMSNorm
from xtl.ops.attention import AttentionMaskSpec, flash_attention, get_attn_impl_fn
from xtl.ops.rope import apply_rotary_pos_emb
from xtl.ops.rope_interleave import apply_rotary_pos_emb_interleave
from xtl.ops.ulysses import ContextParallelAttention


class MultiLatentAttention(ContextParallelAttention, nn.Module):
    """MLA with optional q LoRA, decoupled rotary dims and interleaved rotary pairs.

    Queries: ``q_b(norm(q_a(x)))`` (or ``q_proj(x)`` without q LoRA) split into ``qk_nope_head_dim`` plain and
    ``qk_rope_head_dim`` rotary dims per head. Keys/values: ``kv_a_proj_with_mqa(x)`` gives a ``kv_lora_rank``
    latent (normed, expanded per head by ``kv_b_proj``) and one rotary key shared by all heads.

    Args:
        hidden_size: Model width.
        num_heads: Attention heads.
        q_lora_rank: Rank of the query LoRA, or ``None`` for a full query projection.
        kv_lora_rank: Rank of the key/value latent.
        qk_nope_head_dim: Non-rotary query/key dims per head.
        qk_rope_head_dim: Rotary query/key dims per head.
        v_head_dim: Value dims per head.
        scaling: Softmax scale (``qk_head_dim**-0.5``, times the yarn mscale correction where it applies).
        bias: Bias on ``q_a``, ``kv_a`` and ``o`` projections.
        rope_interleave: Rotary dims are interleaved pairs (DeepSeek-V3 checkpoints).
        latent_norm_eps: Epsilon of the two latent RMSNorms.
        attn_impl: Attention implementation (resolved per call).
        dropout: Attention dropout in training.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scaling: float,
        bias: bool = False,
        rope_interleave: bool = True,
        latent_norm_eps: float = 1e-6,
        attn_impl: str = "auto",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_heads  # the latent expands to one key/value head per query head
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scaling = scaling
        self.rope_interleave = rope_interleave
        self.attn_impl = attn_impl
        self.dropout = dropout
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, latent_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, latent_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMaskSpec,
        kv_cache: LayerKVCache = NO_LAYER_KV_CACHE,
    ) -> torch.Tensor:
        """Attend ``hidden_states`` ``(B, T, C)`` under ``mask``; returns ``(B, T, C)``.

        ``kv_cache`` stores this call's per-head keys and values (expanded from the latent) and returns every
        cached one to attend over.
        """
        batch, seq_len = hidden_states.shape[:-1]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(batch, seq_len, -1, self.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        compressed = self.kv_a_proj_with_mqa(hidden_states)
        kv_latent, k_rot = torch.split(compressed, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_latent = self.kv_a_layernorm(kv_latent).view(batch, 1, seq_len, self.kv_lora_rank)
        k_rot = k_rot.view(batch, 1, seq_len, self.qk_rope_head_dim)

        cos, sin = position_embeddings
        rotary = apply_rotary_pos_emb_interleave if self.rope_interleave else apply_rotary_pos_emb
        q_rot, k_rot = rotary(q_rot, k_rot, cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k, v = kv_cache.update(*self._expand_kv(kv_latent, k_rot))

        attn = self.attention_fn()
        flash = get_attn_impl_fn(self.attn_impl) is flash_attention
        pad = flash and self.v_head_dim != self.qk_head_dim  # flash needs equal head dims
        if pad:
            v = F.pad(v, (0, self.qk_head_dim - self.v_head_dim))
        out = attn(q, k, v, mask, self.scaling, self.dropout if self.training else 0.0)
        if pad:
            out = out[..., : self.v_head_dim]
        return self.o_proj(out.reshape(batch, seq_len, -1).contiguous())

    def _expand_kv(self, kv_latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, _, seq_len, _ = kv_latent.shape
        kv = self.kv_b_proj(kv_latent).view(batch, seq_len, -1, self.qk_nope_head_dim + self.v_head_dim)
        kv = kv.transpose(1, 2)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
        k = kv.new_empty(*kv.shape[:-1], self.qk_head_dim)  # copy into one tensor: transformers' op order
        k[..., : self.qk_nope_head_dim].copy_(k_nope)
        k[..., self.qk_nope_head_dim :].copy_(k_rot)
        return k, v
