"""Kernels behind selectors. ``XTL_HF_IMPL=1`` makes every selector return the transformers-exact op."""

from xtl.ops.attention import ATTN_IMPLS, AttentionMaskSpec, get_attn_impl_fn
from xtl.ops.cross_entropy import IGNORE_INDEX, causal_lm_loss, cross_entropy_mean, cross_entropy_sum, shift_labels
from xtl.ops.grouped_gemm import get_grouped_gemm_fn
from xtl.ops.moe_loss import balance_loss, z_loss
from xtl.ops.rms_norm import get_rms_norm_fn
from xtl.ops.rope import apply_rotary_pos_emb

__all__ = [
    "ATTN_IMPLS",
    "IGNORE_INDEX",
    "AttentionMaskSpec",
    "apply_rotary_pos_emb",
    "balance_loss",
    "causal_lm_loss",
    "cross_entropy_mean",
    "cross_entropy_sum",
    "get_attn_impl_fn",
    "get_grouped_gemm_fn",
    "get_rms_norm_fn",
    "shift_labels",
    "z_loss",
]
