"""Qwen2 / Qwen2.5 configs (bias on q/k/v, none on the output projection)."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Qwen2Config

from xtl.model.dense.config import DenseConfig, SlidingWindowMixin
from xtl.module.rope import RopeConfig


@dataclass
class Qwen2DenseConfig(SlidingWindowMixin, DenseConfig):
    """Qwen2 family (``model_type='qwen2'``)."""

    hf_config_class = Qwen2Config
    hf_architecture = "Qwen2ForCausalLM"

    @property
    def qkv_bias(self) -> bool:
        return True

    @property
    def o_bias(self) -> bool:
        return False


@dataclass
class _Qwen25Base(Qwen2DenseConfig):
    vocab_size: int = 151936
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151645
    dtype: str | None = "bfloat16"
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(rope_theta=1000000.0))


@dataclass
class Qwen25_0P5BConfig(_Qwen25Base):
    """Qwen2.5-0.5B."""

    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int | None = 2
    max_window_layers: int = 24
    tie_word_embeddings: bool = True


@dataclass
class Qwen25_7BConfig(_Qwen25Base):
    """Qwen2.5-7B."""

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int | None = 4
    max_window_layers: int = 28
