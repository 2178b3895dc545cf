"""Multimodal rotary embedding (Qwen3-VL): text, height and width positions interleaved over the frequencies."""

from __future__ import annotations

import torch
from torch import nn


class MultimodalRotaryEmbedding(nn.Module):
    """``cos``/``sin`` for ``(3, B, T)`` (temporal, height, width) positions, as transformers' Qwen3-VL text rotary.

    Frequency ``j`` takes the height position when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, the width
    position when ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, and the temporal position otherwise
    (interleaved M-RoPE). ``(B, T)`` positions are used on all three axes (text-only input).

    Args:
        head_dim: Width of one attention head (``sum(mrope_section) == head_dim // 2``).
        rope_theta: Base wavelength.
        mrope_section: Frequencies per axis ``[t, h, w]``.
    """

    def __init__(self, head_dim: int, rope_theta: float, mrope_section: list[int]) -> None:
        super().__init__()
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim // 2 = {head_dim // 2}")
        self.mrope_section = list(mrope_section)
        with torch.device("cpu"):  # a plain CPU tensor (not a buffer), also when built under a meta device
            self.inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)`` ``(B, T, head_dim)`` in ``dtype`` for ``(3, B, T)`` or ``(B, T)`` positions."""
        if position_ids.dim() == 2:
            position_ids = position_ids[None].expand(3, -1, -1)
        inv_freq = self.inv_freq.to(device=position_ids.device, dtype=torch.float)
        freqs = position_ids[..., None].float() * inv_freq
        cos = self._interleave(freqs.cos())
        sin = self._interleave(freqs.sin())
        return cos.to(dtype=dtype), sin.to(dtype=dtype)

    def _interleave(self, freq: torch.Tensor) -> torch.Tensor:
        out = freq[0].clone()
        for axis in (1, 2):
            idx = slice(axis, self.mrope_section[axis] * 3, 3)
            out[..., idx] = freq[axis, ..., idx]
        return torch.cat((out, out), dim=-1)


__all__ = ["MultimodalRotaryEmbedding"]
