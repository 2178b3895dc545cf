"""GPT-OSS: attention sinks, alternating sliding-window layers, clamped-SwiGLU experts with biases.

transformers stores the experts fused and transposed, with gate/up columns interleaved:
``experts.gate_up_proj`` ``(E, C, 2I)``, ``experts.gate_up_proj_bias`` ``(E, 2I)``, ``experts.down_proj``
``(E, I, C)``, ``experts.down_proj_bias`` ``(E, C)``; the router is ``mlp.router``. The layout hooks convert to
xtl's grouped layout (``gate_up`` ``(E, 2I, C)`` gate rows then up rows, ``down`` ``(E, C, I)``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers import GptOssConfig

from xtl.model.moe.config import MoEConfig
from xtl.model.moe.moe import MoE
from xtl.module.experts import ClampedSwiGLUExperts, GroupedExperts, deinterleave_gate_up, interleave_gate_up
from xtl.module.fp32_norm import Fp32ScaleRMSNorm
from xtl.module.norm import RMSNorm
from xtl.module.rope import RopeConfig
from xtl.module.router import Router, TopKSoftmaxRouter
from xtl.module.sink_attention import SinkAttention

_EXPERT_KEY = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up|gate_up_bias|down|down_bias)")
_HF_EXPERT_NAMES = {
    "gate_up": "gate_up_proj",
    "gate_up_bias": "gate_up_proj_bias",
    "down": "down_proj",
    "down_bias": "down_proj_bias",
}


def _default_rope() -> RopeConfig:
    return RopeConfig(
        rope_type="yarn",
        rope_theta=150000.0,
        params={
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    )


@dataclass
class GptOssMoEConfig(MoEConfig):
    """GPT-OSS family (``model_type='gpt_oss'``). ``intermediate_size`` is the width of one expert."""

    hf_config_class = GptOssConfig
    hf_architecture = "GptOssForCausalLM"
    per_layer_fields: ClassVar[tuple[str, ...]] = ("layer_types",)

    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    head_dim: int | None = 64
    rms_norm_eps: float = 1e-5
    attention_bias: bool = True
    sliding_window: int | None = 128
    layer_types: list[str] | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    rope: RopeConfig = field(default_factory=_default_rope)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.num_hidden_layers)
            ]

    @property
    def num_routed_experts(self) -> int:
        return self.num_local_experts

    @property
    def expert_intermediate_size(self) -> int:
        return self.intermediate_size

    @property
    def attention_sinks(self) -> bool:
        """A learned sink logit per attention head."""
        return True

    @property
    def router_bias(self) -> bool:
        """The router gate has a bias."""
        return True

    @property
    def expert_bias(self) -> bool:
        """The routed experts' projections have biases."""
        return True

    @property
    def norm_class(self) -> type[RMSNorm]:
        return Fp32ScaleRMSNorm

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window for layers typed ``sliding_attention``."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    def build_router(self) -> Router:
        """Biased gate, softmax over the selected top-k logits."""
        return TopKSoftmaxRouter(self.hidden_size, self.num_local_experts, self.num_experts_per_tok)

    def build_experts(self) -> GroupedExperts:
        """Clamped-SwiGLU experts with biases."""
        return ClampedSwiGLUExperts(
            self.num_local_experts,
            self.hidden_size,
            self.intermediate_size,
            alpha=self.swiglu_alpha,
            limit=self.swiglu_limit,
            gemm_impl=self.expert_gemm_impl,
        )

    def build(self) -> GptOss:
        """Build the GPT-OSS model."""
        return GptOss(self)


class GptOss(MoE):
    """:class:`MoE` with sink attention and transformers' fused/interleaved expert layout."""

    config: GptOssMoEConfig
    attention_class = SinkAttention

    def to_hf_key_list(self, key: str) -> list[str]:
        """The router is ``mlp.router``; each grouped expert parameter is one fused HF tensor."""
        match = _EXPERT_KEY.fullmatch(key)
        if match is not None:
            return [f"model.layers.{match[1]}.mlp.experts.{_HF_EXPERT_NAMES[match[2]]}"]
        return super().to_hf_key_list(re.sub(r"\.mlp\.gate\.", ".mlp.router.", key))

    def hf_to_param(self, key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Transpose and de-interleave transformers' expert tensors."""
        match = _EXPERT_KEY.fullmatch(key)
        if match is None:
            return super().hf_to_param(key, tensors)
        (tensor,) = tensors
        if match[2] == "gate_up":
            return deinterleave_gate_up(tensor.transpose(1, 2), dim=1).contiguous()
        if match[2] == "gate_up_bias":
            return deinterleave_gate_up(tensor, dim=1).contiguous()
        if match[2] == "down":
            return tensor.transpose(1, 2).contiguous()
        return tensor

    def param_to_hf(self, key: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of :meth:`hf_to_param`."""
        match = _EXPERT_KEY.fullmatch(key)
        if match is None:
            return super().param_to_hf(key, tensor)
        if match[2] == "gate_up":
            return [interleave_gate_up(tensor, dim=1).transpose(1, 2).contiguous()]
        if match[2] == "gate_up_bias":
            return [interleave_gate_up(tensor, dim=1).contiguous()]
        if match[2] == "down":
            return [tensor.transpose(1, 2).contiguous()]
        return [tensor]

    def hf_matrix_rows(self, key: str, rows: int) -> tuple[int, ...]:
        """An expert's ``gate_up`` matrix is one HF matrix (transformers' fused ``gate_up_proj``)."""
        if _EXPERT_KEY.fullmatch(key) is not None:
            return (rows,)
        return super().hf_matrix_rows(key, rows)


@dataclass
class _GptOssBase(GptOssMoEConfig):
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 131072
    eos_token_id: int | list[int] | None = 200002
    pad_token_id: int | None = 199999
    dtype: str | None = "bfloat16"


@dataclass
class GptOss20BConfig(_GptOssBase):
    """gpt-oss-20b (21B total, 3.6B active)."""

    num_hidden_layers: int = 24
    num_local_experts: int = 32


@dataclass
class GptOss120BConfig(_GptOssBase):
    """gpt-oss-120b (117B total, 5.1B active)."""

    num_hidden_layers: int = 36
    num_local_experts: int = 128
