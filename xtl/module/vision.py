"""The Qwen3-VL vision tower: patch embedding, 2-D rotary blocks, patch merger and DeepStack mergers.

Parameter names equal transformers' (``patch_embed.proj``, ``pos_embed``, ``blocks.{i}.attn.qkv``, ``merger``,
``deepstack_merger_list.{j}``), so checkpoints map 1:1 under the ``model.visual.`` prefix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

from xtl.module.traits import SelfInitializing
from xtl.ops.vision import apply_rotary_pos_emb_vision, get_patch_embed_fn, get_vision_attn_fn


class LayerNorm(SelfInitializing, nn.LayerNorm):
    """``nn.LayerNorm`` that initializes itself (ones / zeros) under :meth:`xtl.model.base.BaseModel.init_weights`."""

    def init_param(self, attr: str, tensor: torch.Tensor, std: float) -> None:
        """Fill ``weight`` with ones and ``bias`` with zeros."""
        tensor.fill_(1.0 if attr == "weight" else 0.0)


class VisionPatchEmbed(nn.Module):
    """Flattened ``(N, C * tp * p * p)`` patches -> ``(N, hidden)``: a 3-D convolution with stride = kernel.

    The weight keeps transformers' ``Conv3d`` shape; the op is :func:`xtl.ops.vision.get_patch_embed_fn`'s (the
    convolution under the HF-parity selectors, else the same map as one linear).
    """

    def __init__(self, in_channels: int, hidden_size: int, patch_size: int, temporal_patch_size: int) -> None:
        super().__init__()
        self.shape = (in_channels, temporal_patch_size, patch_size, patch_size)
        self.hidden_size = hidden_size
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Embed every patch (as transformers: a conv over one kernel-sized volume per patch)."""
        x = pixel_values.view(-1, *self.shape).to(self.proj.weight.dtype)
        return get_patch_embed_fn()(x, self.proj.weight, self.proj.bias)


class VisionRotaryEmbedding(nn.Module):
    """Axial 2-D rotary: the first half of the frequencies rotate by row, the second by column."""

    def __init__(self, head_dim: int, rope_theta: float = 10000.0) -> None:
        super().__init__()
        dim = head_dim // 2
        with torch.device("cpu"):
            self.inv_freq = 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(N, 2)`` (row, column) positions -> fp32 ``cos``/``sin`` ``(N, head_dim)``."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=position_ids.device, dtype=torch.float)
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention within each image, with a fused ``qkv`` projection."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scaling = (hidden_size // num_heads) ** -0.5
        self.qkv = nn.Linear(hidden_size, hidden_size * 3, bias=True)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(
        self, x: torch.Tensor, bounds: list[int], position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Attend ``(N, C)`` patches; ``bounds`` are the patch offsets of the images."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = apply_rotary_pos_emb_vision(q, k, *position_embeddings)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = get_vision_attn_fn()(q, k, v, bounds, self.scaling)
        return self.proj(out.reshape(n, -1).contiguous())


class VisionMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden_size, intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(intermediate_size, hidden_size, bias=True)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP."""
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.norm1 = LayerNorm(hidden_size, eps=1e-6)
        self.norm2 = LayerNorm(hidden_size, eps=1e-6)
        self.attn = VisionAttention(hidden_size, num_heads)
        self.mlp = VisionMLP(hidden_size, intermediate_size, hidden_act)

    def forward(
        self, x: torch.Tensor, bounds: list[int], position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Run the block on ``(N, C)`` patches."""
        x = x + self.attn(self.norm1(x), bounds, position_embeddings)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Merge each ``m x m`` block of patches into one LM token: norm, ``fc1``, GELU, ``fc2``.

    Args:
        hidden_size: Vision width C.
        out_hidden_size: LM width.
        spatial_merge_size: m.
        use_postshuffle_norm: Normalize the concatenated ``m*m*C`` vector (DeepStack mergers) instead of each patch.
    """

    def __init__(
        self, hidden_size: int, out_hidden_size: int, spatial_merge_size: int, use_postshuffle_norm: bool
    ) -> None:
        super().__init__()
        self.merged_size = hidden_size * spatial_merge_size**2
        self.use_postshuffle_norm = use_postshuffle_norm
        self.norm = LayerNorm(self.merged_size if use_postshuffle_norm else hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_size, out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, C)`` patches in merge-block order -> ``(N / m^2, out_hidden_size)``."""
        x = self.norm(x.view(-1, self.merged_size) if self.use_postshuffle_norm else x).view(-1, self.merged_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """The Qwen3-VL vision encoder.

    Args:
        config: A vision config with transformers' field names (``depth``, ``hidden_size``, ``num_heads``,
            ``patch_size``, ``spatial_merge_size``, ``deepstack_visual_indexes``, ...; see
            :class:`xtl.model.compose.Qwen3VLVisionConfig`).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        c = config
        self.spatial_merge_size = c.spatial_merge_size
        self.num_grid_per_side = int(c.num_position_embeddings**0.5)
        self.deepstack_visual_indexes = list(c.deepstack_visual_indexes)
        self.patch_embed = VisionPatchEmbed(c.in_channels, c.hidden_size, c.patch_size, c.temporal_patch_size)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.rotary_pos_emb = VisionRotaryEmbedding(c.hidden_size // c.num_heads, c.rope_theta)
        self.blocks = nn.ModuleList(
            [VisionBlock(c.hidden_size, c.num_heads, c.intermediate_size, c.hidden_act) for _ in range(c.depth)]
        )
        self.merger = PatchMerger(c.hidden_size, c.out_hidden_size, c.spatial_merge_size, False)
        self.deepstack_merger_list = nn.ModuleList(
            [
                PatchMerger(c.hidden_size, c.out_hidden_size, c.spatial_merge_size, True)
                for _ in self.deepstack_visual_indexes
            ]
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Encode flattened patches of the images (``grid_thw`` ``(n_images, 3)``, patches in merge-block order).

        Returns:
            The merged image tokens ``(sum(t*h*w) / m^2, out_hidden_size)`` and one DeepStack feature of the same
            shape per ``deepstack_visual_indexes`` entry.
        """
        hidden, deepstack = self.encode(pixel_values, grid_thw)
        return self.merger(hidden), deepstack

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The blocks' output ``(sum(t*h*w), hidden_size)`` (before the merger) and the DeepStack features."""
        x = self.patch_embed(pixel_values.to(self.patch_embed.proj.weight.dtype))
        x = x + self.position_embeddings(grid_thw).to(x.dtype)
        rope = self.rotary_pos_emb(get_vision_position_ids(grid_thw, self.spatial_merge_size))
        per_frame = (grid_thw[:, 1] * grid_thw[:, 2]).repeat_interleave(grid_thw[:, 0])
        bounds = [0, *per_frame.cumsum(0).tolist()]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, bounds, rope)
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return x, deepstack

    def position_embeddings(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """The learned square position table, bilinearly resampled to each image's grid (merge-block order)."""
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw,
            num_grid_per_side=self.num_grid_per_side,
            mode="bilinear",
            align_corners=True,
            spatial_merge_size=self.spatial_merge_size,
        )
        return (self.pos_embed(indices) * weights[:, :, None]).sum(1)


__all__ = [
    "LayerNorm",
    "PatchMerger",
    "VisionAttention",
    "VisionBlock",
    "VisionMLP",
    "VisionPatchEmbed",
    "VisionRotaryEmbedding",
    "VisionTower",
]
