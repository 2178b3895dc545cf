"""Qwen3 dense configs (per-head q/k RMSNorm, explicit head_dim)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Qwen3Config

from xtl.model.dense.config import DenseConfig, SlidingWindowMixin
from xtl.module.rope import RopeConfig


@dataclass
class Qwen3DenseConfig(SlidingWindowMixin, DenseConfig):
    """Qwen3 family (``model_type='qwen3'``)."""

    hf_config_class = Qwen3Config
    hf_architecture = "Qwen3ForCausalLM"

    @property
    def qk_norm(self) -> bool:
        return True


@dataclass
class _Qwen3Base(Qwen3DenseConfig):
    vocab_size: int = 151936
    head_dim: int | None = 128
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151645
    dtype: str | None = "bfloat16"
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(rope_theta=1000000.0))


@dataclass
class Qwen3Dense0P6BConfig(_Qwen3Base):
    """Qwen3-0.6B."""

    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    max_window_layers: int = 28
    tie_word_embeddings: bool = True


@dataclass
class Qwen3Dense1P7BConfig(_Qwen3Base):
    """Qwen3-1.7B."""

    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    max_window_layers: int = 28
    tie_word_embeddings: bool = True


@dataclass
class Qwen3Dense4BConfig(_Qwen3Base):
    """Qwen3-4B."""

    hidden_size: int = 2560
    intermediate_size: int = 9728
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    max_window_layers: int = 36
    tie_word_embeddings: bool = True


@dataclass
class Qwen3Dense8BConfig(_Qwen3Base):
    """Qwen3-8B."""

    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    max_window_layers: int = 36


@dataclass
class Qwen3Dense14BConfig(_Qwen3Base):
    """Qwen3-14B."""

    hidden_size: int = 5120
    intermediate_size: int = 17408
    num_hidden_layers: int = 40
    num_attention_heads: int = 40
    max_window_layers: int = 40


@dataclass
class Qwen3Dense32BConfig(_Qwen3Base):
    """Qwen3-32B."""

    hidden_size: int = 5120
    intermediate_size: int = 25600
    num_hidden_layers: int = 64
    num_attention_heads: int = 64
    max_window_layers: int = 64
