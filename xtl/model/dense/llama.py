"""Llama (2/3/3.1/3.2) configs."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import LlamaConfig

from xtl.model.dense.config import DenseConfig
from xtl.module.rope import RopeConfig


@dataclass
class LlamaDenseConfig(DenseConfig):
    """Llama family (``model_type='llama'``)."""

    hf_config_class = LlamaConfig
    hf_architecture = "LlamaForCausalLM"

    pretraining_tp: int = 1


def _llama3_rope(factor: float) -> RopeConfig:
    return RopeConfig(
        rope_type="llama3",
        rope_theta=500000.0,
        params={
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


@dataclass
class _Llama3Base(LlamaDenseConfig):
    vocab_size: int = 128256
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = 8
    bos_token_id: int | None = 128000
    eos_token_id: int | list[int] | None = 128001
    dtype: str | None = "bfloat16"


@dataclass
class Llama32_1BConfig(_Llama3Base):
    """Llama-3.2-1B."""

    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 16
    num_attention_heads: int = 32
    head_dim: int | None = 64
    tie_word_embeddings: bool = True
    rope: RopeConfig = field(default_factory=lambda: _llama3_rope(32.0))


@dataclass
class Llama32_3BConfig(_Llama3Base):
    """Llama-3.2-3B."""

    hidden_size: int = 3072
    intermediate_size: int = 8192
    num_hidden_layers: int = 28
    num_attention_heads: int = 24
    head_dim: int | None = 128
    tie_word_embeddings: bool = True
    rope: RopeConfig = field(default_factory=lambda: _llama3_rope(32.0))


@dataclass
class Llama31_8BConfig(_Llama3Base):
    """Llama-3.1-8B."""

    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    head_dim: int | None = 128
    rope: RopeConfig = field(default_factory=lambda: _llama3_rope(8.0))


@dataclass
class Llama31_70BConfig(_Llama3Base):
    """Llama-3.1-70B."""

    hidden_size: int = 8192
    intermediate_size: int = 28672
    num_hidden_layers: int = 80
    num_attention_heads: int = 64
    head_dim: int | None = 128
    rope: RopeConfig = field(default_factory=lambda: _llama3_rope(8.0))
