"""Qwen3-MoE configs: GQA with per-head q/k norms, softmax top-k routing, experts stored per expert."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Qwen3MoeConfig

from xtl.model.moe.config import MoEConfig
from xtl.module.rope import RopeConfig


@dataclass
class Qwen3MoEConfig(MoEConfig):
    """Qwen3-MoE family (``model_type='qwen3_moe'``)."""

    hf_config_class = Qwen3MoeConfig
    hf_architecture = "Qwen3MoeForCausalLM"
    hf_extra_fields = ("head_dim",)  # not a dataclass field of Qwen3MoeConfig, but read by its attention

    num_experts: int = 128
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None

    @property
    def qk_norm(self) -> bool:
        return True

    @property
    def num_routed_experts(self) -> int:
        return self.num_experts

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """Every layer uses the window when ``use_sliding_window`` is set (as transformers)."""
        return self.sliding_window if self.use_sliding_window else None

    def is_moe_layer(self, layer_idx: int) -> bool:
        """MoE unless listed in ``mlp_only_layers``, every ``decoder_sparse_step``-th layer."""
        return (
            layer_idx not in (self.mlp_only_layers or [])
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


@dataclass
class _Qwen3MoEBase(Qwen3MoEConfig):
    vocab_size: int = 151936
    head_dim: int | None = 128
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151645
    dtype: str | None = "bfloat16"
    mlp_only_layers: list[int] | None = field(default_factory=list)
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(rope_theta=1000000.0))


@dataclass
class Qwen3MoE30BA3Config(_Qwen3MoEBase):
    """Qwen3-30B-A3B."""

    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 48
    num_attention_heads: int = 32


@dataclass
class Qwen3MoE235BA22Config(_Qwen3MoEBase):
    """Qwen3-235B-A22B."""

    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 1536
    num_hidden_layers: int = 94
    num_attention_heads: int = 64
