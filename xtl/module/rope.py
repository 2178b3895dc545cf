"""Rotary position embeddings: the config that round-trips with transformers, and the module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass
class RopeConfig:
    """Rotary parameters in transformers' ``rope_parameters`` form.

    Attributes:
        rope_type: ``default``, ``linear``, ``dynamic``, ``llama3`` or ``yarn``.
        rope_theta: Base wavelength.
        params: The type's scaling parameters (``factor``, ``original_max_position_embeddings``, ...).
    """

    rope_type: str = "default"
    rope_theta: float = 10000.0
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; xtl supports {ROPE_TYPES}")

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig | dict) -> RopeConfig:
        """Read rope settings from a transformers config or a raw ``config.json`` dict.

        Handles ``rope_parameters`` (transformers >= 5) and the legacy ``rope_scaling`` + ``rope_theta`` pair.
        """
        get = hf_config.get if isinstance(hf_config, dict) else (lambda k, d=None: getattr(hf_config, k, d))
        params = get("rope_parameters", None)
        if not params or "rope_theta" not in params:
            params = dict(get("rope_scaling", None) or {})
            params.setdefault("rope_theta", get("rope_theta", 10000.0))
        params = dict(params)
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        params.pop("type", None)
        theta = float(params.pop("rope_theta"))
        return cls(rope_type=rope_type, rope_theta=theta, params=params)

    def to_hf(self) -> dict[str, Any]:
        """The ``rope_parameters`` dict transformers expects."""
        return {"rope_type": self.rope_type, "rope_theta": self.rope_theta, **self.params}


class RotaryEmbedding(nn.Module):
    """Computes ``cos``/``sin`` tables for given positions, with transformers' own inverse-frequency functions.

    The inverse frequencies are a plain CPU tensor computed at construction (also under a ``meta`` device
    context), moved to the input's device on use, so a meta-built model needs no re-initialization here.
    """

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.rope_type = hf_config.rope_parameters["rope_type"]
        self.original_max_seq_len = hf_config.max_position_embeddings
        self.inv_freq, self.attention_scaling = self._compute(seq_len=None)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)`` of shape ``(B, T, D)`` in ``dtype`` for ``position_ids`` ``(B, T)``."""
        inv_freq, scaling = self.inv_freq, self.attention_scaling
        if self.rope_type == "dynamic":
            seq_len = int(position_ids.max()) + 1
            if seq_len > self.original_max_seq_len:
                inv_freq, scaling = self._compute(seq_len=seq_len)
        freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * scaling
        sin = emb.sin() * scaling
        return cos.to(dtype=dtype), sin.to(dtype=dtype)

    def _compute(self, seq_len: int | None) -> tuple[torch.Tensor, float]:
        with torch.device("cpu"):
            if self.rope_type == "default":
                return _default_inv_freq(self.hf_config)
            return ROPE_INIT_FUNCTIONS[self.rope_type](self.hf_config, torch.device("cpu"), seq_len=seq_len)


def _default_inv_freq(hf_config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    base = hf_config.rope_parameters["rope_theta"]
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    dim = int(head_dim * hf_config.rope_parameters.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    return inv_freq, 1.0
