"""DeepSeek-V3: multi-head latent attention, aux-loss-free group-limited sigmoid routing, shared experts."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from torch import nn
from transformers import DeepseekV3Config

from xtl.model.moe.config import MoEConfig
from xtl.model.moe.moe import MoE
from xtl.module.mla import MultiLatentAttention
from xtl.module.rope import RopeConfig
from xtl.module.router import NoAuxTopKRouter, Router

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class DeepSeekV3Config(MoEConfig):
    """DeepSeek-V3 family (``model_type='deepseek_v3'``).

    The first ``first_k_dense_replace`` layers are dense; the others route to ``n_routed_experts`` experts in
    ``n_group`` groups (``topk_group`` usable per token) and add ``n_shared_experts`` always-on experts.
    Multi-token-prediction layers of the checkpoint (``model.layers.{num_hidden_layers}...``) are not built and
    are ignored on load.
    """

    hf_config_class = DeepseekV3Config
    hf_architecture = "DeepseekV3ForCausalLM"

    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int | None = 128
    qk_nope_head_dim: int = 128
    n_group: int | None = 8
    topk_group: int | None = 4
    first_k_dense_replace: int | None = 3
    pretraining_tp: int | None = 1
    rope_interleave: bool | None = True
    num_mtp_layers: int = 1
    output_router_logits: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self.head_dim = self.qk_rope_head_dim  # the rotary width, as transformers derives it

    @property
    def num_routed_experts(self) -> int:
        return self.n_routed_experts

    @property
    def shared_experts_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def router_bias(self) -> bool:
        """The router keeps a per-expert score-correction bias (a checkpoint tensor)."""
        return True

    @property
    def is_mla(self) -> bool:
        """Attention is multi-head latent attention (``q_lora_rank``, ``kv_lora_rank``, ``qk_*_head_dim``, ...)."""
        return True

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim**-0.5``, times ``mscale**2`` for scaled rotary with ``mscale_all_dim`` (transformers)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        mscale_all_dim = self.rope.params.get("mscale_all_dim", 0)
        factor = self.rope.params.get("factor", 1.0)
        if self.rope.rope_type != "default" and mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * mscale * mscale
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layers from ``first_k_dense_replace`` on are MoE."""
        return layer_idx >= (self.first_k_dense_replace or 0)

    def build_router(self) -> Router:
        """Sigmoid, group-limited, aux-loss-free router."""
        return NoAuxTopKRouter(
            self.hidden_size,
            self.n_routed_experts,
            self.num_experts_per_tok,
            n_group=self.n_group or 1,
            topk_group=self.topk_group or 1,
            norm_topk_prob=bool(self.norm_topk_prob),
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def build(self) -> DeepSeekV3:
        """Build the DeepSeek-V3 model."""
        return DeepSeekV3(self)


class DeepSeekV3(MoE):
    """:class:`MoE` with multi-head latent attention; checkpoint MTP layers are ignored."""

    config: DeepSeekV3Config

    def build_attention(self, layer_idx: int) -> nn.Module:
        """Multi-head latent attention (latent norms use transformers' fixed eps of 1e-6)."""
        cfg = self.config
        return MultiLatentAttention(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            scaling=cfg.softmax_scale,
            bias=cfg.attention_bias,
            rope_interleave=bool(cfg.rope_interleave),
            latent_norm_eps=1e-6,
            attn_impl=cfg.attn_impl,
            dropout=cfg.attention_dropout,
        )

    def _ignorable_hf_key(self, key: str) -> bool:
        match = _LAYER_KEY.match(key)
        if match and int(match[1]) >= self.config.num_hidden_layers:
            return True
        return super()._ignorable_hf_key(key)


@dataclass
class DeepSeekV3_671BConfig(DeepSeekV3Config):
    """DeepSeek-V3 (671B total, 37B active)."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    num_experts_per_tok: int = 8
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    dtype: str | None = "bfloat16"
    rope: RopeConfig = field(
        default_factory=lambda: RopeConfig(
            rope_type="yarn",
            rope_theta=10000.0,
            params={
                "factor": 40.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
            },
        )
    )
