"""Ops of vision towers: patch embedding, 2-D rotary application and bidirectional per-image attention.

``XTL_HF_IMPL=1`` makes :func:`get_vision_attn_fn` return :func:`eager_vision_attention`, bitwise equal to
transformers' eager path of Qwen3-VL's vision blocks (one image at a time, fp32 softmax), and
:func:`get_patch_embed_fn` return :func:`conv_patch_embed` (transformers' ``Conv3d``); otherwise they return
:func:`sdpa_vision_attention` and :func:`linear_patch_embed` (the stride-equals-kernel convolution as one GEMM).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from xtl.ops.rope import rotate_half
from xtl.ops.selector import hf_impl_enabled

VisionAttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int], float], torch.Tensor]


def apply_rotary_pos_emb_vision(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` ``(N, H, D)`` by ``cos``/``sin`` ``(N, D)`` in fp32, returning the input dtypes."""
    q_dtype, k_dtype = q.dtype, k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed.to(q_dtype), k_embed.to(k_dtype)


def get_patch_embed_fn() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """The patch embedding: ``Conv3d`` (HF-exact) under ``XTL_HF_IMPL=1``, else the equivalent linear."""
    return conv_patch_embed if hf_impl_enabled() else linear_patch_embed


def conv_patch_embed(patches: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(N, C, tp, p, p)`` patches, ``conv3d`` with stride = kernel of ``weight`` ``(D, C, tp, p, p)``: ``(N, D)``."""
    return F.conv3d(patches, weight, bias, stride=weight.shape[2:]).view(patches.shape[0], -1)


def linear_patch_embed(patches: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`conv_patch_embed` as one matrix product (equal up to summation order)."""
    return F.linear(patches.reshape(patches.shape[0], -1), weight.reshape(weight.shape[0], -1), bias)


def get_vision_attn_fn() -> VisionAttnFn:
    """The bidirectional vision attention: eager (HF-exact) under ``XTL_HF_IMPL=1``, else SDPA."""
    return eager_vision_attention if hf_impl_enabled() else sdpa_vision_attention


def eager_vision_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scaling: float
) -> torch.Tensor:
    """Full attention within each image of ``(1, H, N, D)`` q/k/v (``bounds``: patch offsets); ``(1, N, H, D)``."""
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        weights = torch.matmul(qi, ki.transpose(2, 3)) * scaling
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(qi.dtype)
        outs.append(torch.matmul(weights, vi).transpose(1, 2).contiguous())
    return torch.cat(outs, dim=1)


def sdpa_vision_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scaling: float
) -> torch.Tensor:
    """:func:`eager_vision_attention` through ``scaled_dot_product_attention``."""
    outs = [
        F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale=scaling).transpose(1, 2)
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, dim=1)


__all__ = [
    "apply_rotary_pos_emb_vision",
    "conv_patch_embed",
    "get_patch_embed_fn",
    "linear_patch_embed",
    "eager_vision_attention",
    "get_vision_attn_fn",
    "sdpa_vision_attention",
]
