"""Rotary embedding on interleaved pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout)."""

from __future__ import annotations

import torch


def apply_rotary_pos_emb_interleave(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate interleaved pairs of ``q``/``k`` ``(B, H, T, D)``; output de-interleaved (transformers' op order).

    ``cos``/``sin`` are ``(B, T, D)`` tables built as ``cat(freqs, freqs)``; the first half holds each pair's angle.
    """
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed
