"""Rotary position embedding application."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from xtl.ops.selector import hf_impl_enabled

RopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def get_rope_fn(device: torch.device | None = None) -> RopeFn:
    """Return the op ``fn(q, k, cos, sin, unsqueeze_dim=1) -> (q, k)`` applying rotary embeddings on ``device``.

    :func:`apply_rotary_pos_emb` (transformers' exact ops) under ``XTL_HF_IMPL``, off CUDA and where triton is not
    installed; on CUDA :func:`apply_rotary_pos_emb_triton`, the triton kernel of :mod:`xtl.ops.triton_rope` (q and
    k rotated in one launch).

    Args:
        device: Where ``q``/``k`` live (``None``: not CUDA).
    """
    if hf_impl_enabled() or device is None or device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return apply_rotary_pos_emb
    return apply_rotary_pos_emb_triton


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dimension: ``(x1, x2) -> (-x2, x1)``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary embeddings to ``q`` and ``k`` ``(B, H, T, D)`` with ``cos``/``sin`` ``(B, T, D)``."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def apply_rotary_pos_emb_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary_pos_emb` through the triton kernel of :mod:`xtl.ops.triton_rope` (imported on call).

    Same math, computed in fp32 and rounded once to the output dtype; differentiable in ``q`` and ``k``.
    ``unsqueeze_dim=2`` takes ``(B, T, H, D)`` inputs as the torch op does. Inputs the kernel does not cover (odd
    head dim, other ranks, mixed ``q``/``k`` dtypes, tables that require grad, ...) go to the torch op.

    Args:
        q: Queries ``(B, Hq, T, D)`` (any strides).
        k: Keys ``(B, Hk, T, D)``.
        cos: Cosine table, broadcastable to ``(B, T, D)``.
        sin: Sine table, broadcastable to ``(B, T, D)``.
        unsqueeze_dim: The head dimension of ``q``/``k`` (1 or 2), along which ``cos``/``sin`` are broadcast.
    """
    if unsqueeze_dim == 2 and q.dim() == 4 and k.dim() == 4:
        q_out, k_out = apply_rotary_pos_emb_triton(q.transpose(1, 2), k.transpose(1, 2), cos, sin, 1)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    if not _triton_supported(q, k, cos, sin, unsqueeze_dim):
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    from xtl.ops.triton_rope import triton_rotary_pos_emb

    return triton_rotary_pos_emb(q, k, cos, sin)


def _triton_supported(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> bool:
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        return False
    batch, _, seq, dim = q.shape
    if dim % 2 or k.shape[0] != batch or k.shape[2:] != q.shape[2:]:
        return False
    floats = (torch.float32, torch.bfloat16, torch.float16)
    for table in (cos, sin):
        if table.shape[-1] != dim or table.shape[0] not in (1, batch) or table.shape[1] not in (1, seq):
            return False
        if table.device != q.device or table.dtype not in floats:
            return False
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        return False  # the kernel gives the tables no gradient; the torch op does
    return q.dtype == k.dtype and q.dtype in floats and k.device == q.device
