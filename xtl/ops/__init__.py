"""Kernels behind selectors. ``XTL_HF_IMPL=1`` makes every selector return the transformers-exact op.

The switch is read only here: :func:`hf_impl_enabled` (and the :func:`hf_impl` context manager that sets it);
modules call a selector (``get_*_fn`` / ``get_gate_up_layout``) and never read the switch themselves.
"""

from xtl.ops.attention import ATTN_IMPLS, AttentionMaskSpec, get_attn_impl_fn
from xtl.ops.cross_entropy import IGNORE_INDEX, causal_lm_loss, cross_entropy_mean, cross_entropy_sum, shift_labels
from xtl.ops.expert_layout import GateUpLayout, get_gate_up_layout
from xtl.ops.fp8 import blockwise_fp8_linear, blockwise_fp8_path
from xtl.ops.grouped_gemm import get_grouped_gemm_fn
from xtl.ops.moe_dispatch import get_moe_combine_fn, get_moe_gather_fn
from xtl.ops.moe_loss import balance_loss, z_loss
from xtl.ops.moe_routing import get_router_logits_fn
from xtl.ops.rms_norm import get_add_rms_norm_fn, get_rms_norm_fn
from xtl.ops.rope import apply_rotary_pos_emb, get_rope_fn
from xtl.ops.selector import hf_impl, hf_impl_enabled
from xtl.ops.vision import get_patch_embed_fn, get_vision_attn_fn

__all__ = [
    "ATTN_IMPLS",
    "IGNORE_INDEX",
    "AttentionMaskSpec",
    "GateUpLayout",
    "apply_rotary_pos_emb",
    "balance_loss",
    "blockwise_fp8_linear",
    "blockwise_fp8_path",
    "causal_lm_loss",
    "cross_entropy_mean",
    "cross_entropy_sum",
    "get_add_rms_norm_fn",
    "get_attn_impl_fn",
    "get_gate_up_layout",
    "get_grouped_gemm_fn",
    "get_moe_combine_fn",
    "get_moe_gather_fn",
    "get_patch_embed_fn",
    "get_rms_norm_fn",
    "get_rope_fn",
    "get_router_logits_fn",
    "get_vision_attn_fn",
    "hf_impl",
    "hf_impl_enabled",
    "shift_labels",
    "z_loss",
]
