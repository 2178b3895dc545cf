"""Config base of the MoE family: the structural switches each MoE model family sets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from transformers import PretrainedConfig

from xtl.model.dense.config import DenseConfig
from xtl.module.experts import GroupedExperts
from xtl.module.router import Router, SoftmaxTopKRouter


@dataclass
class MoEConfig(DenseConfig):
    """A decoder-only MoE config. Families override the structural properties below, never the body.

    Attributes:
        num_experts_per_tok: Experts per token k.
        moe_intermediate_size: Width of one routed expert.
        norm_topk_prob: Renormalize the selected routing weights.
        expert_gemm_impl: xtl's grouped GEMM implementation for the experts (``auto``, ``loop``, ``torch``,
            ``triton``; the HF-parity selectors force ``loop``).
    """

    # transformers config fields that are not dataclass fields of the transformers config class but must be written
    hf_extra_fields: ClassVar[tuple[str, ...]] = ()
    routed_experts: ClassVar[bool] = True

    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True
    expert_gemm_impl: str = "auto"

    @property
    def num_routed_experts(self) -> int:
        """Routed experts per MoE layer."""
        raise TypeError(f"{type(self).__name__} must define num_routed_experts")

    @property
    def expert_intermediate_size(self) -> int:
        """Width of one routed expert."""
        return self.moe_intermediate_size

    @property
    def shared_experts_intermediate_size(self) -> int:
        """Width of the always-on shared-expert MLP (0: none)."""
        return 0

    @property
    def router_bias(self) -> bool:
        """The router has a bias (a gate bias, or a stored score-correction bias)."""
        return False

    @property
    def expert_bias(self) -> bool:
        """The routed experts' projections have biases."""
        return False

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has routed experts (else a dense MLP of ``intermediate_size``)."""
        return True

    def build_router(self) -> Router:
        """The router of one MoE layer (default: softmax top-k)."""
        return SoftmaxTopKRouter(
            self.hidden_size, self.num_routed_experts, self.num_experts_per_tok, self.norm_topk_prob
        )

    def build_experts(self) -> GroupedExperts:
        """The routed experts of one MoE layer (default: SwiGLU experts)."""
        return GroupedExperts(
            self.num_routed_experts,
            self.hidden_size,
            self.expert_intermediate_size,
            self.hidden_act,
            self.expert_gemm_impl,
        )

    @property
    def hf_config(self) -> PretrainedConfig:
        """The transformers config (inverse of :meth:`from_hf_config`), including :attr:`hf_extra_fields`."""
        config = super().hf_config
        for name in self.hf_extra_fields:
            if getattr(self, name) is not None:
                setattr(config, name, getattr(self, name))
        return config

    def build(self):  # noqa: ANN201 - returns xtl.model.moe.MoE
        """Build the MoE model."""
        from xtl.model.moe.moe import MoE

        return MoE(self)
