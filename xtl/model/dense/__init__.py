"""Dense model family: Llama, Qwen2, Qwen3."""

from xtl.model.dense.config import DenseConfig
from xtl.model.dense.dense import Dense
from xtl.model.dense.llama import (
    Llama31_8BConfig,
    Llama31_70BConfig,
    Llama32_1BConfig,
    Llama32_3BConfig,
    LlamaDenseConfig,
)
from xtl.model.dense.qwen2 import Qwen2DenseConfig, Qwen25_0P5BConfig, Qwen25_7BConfig
from xtl.model.dense.qwen3 import (
    Qwen3Dense0P6BConfig,
    Qwen3Dense1P7BConfig,
    Qwen3Dense4BConfig,
    Qwen3Dense8BConfig,
    Qwen3Dense14BConfig,
    Qwen3Dense32BConfig,
    Qwen3DenseConfig,
)

__all__ = [
    "Dense",
    "DenseConfig",
    "Llama31_70BConfig",
    "Llama31_8BConfig",
    "Llama32_1BConfig",
    "Llama32_3BConfig",
    "LlamaDenseConfig",
    "Qwen25_0P5BConfig",
    "Qwen25_7BConfig",
    "Qwen2DenseConfig",
    "Qwen3Dense0P6BConfig",
    "Qwen3Dense14BConfig",
    "Qwen3Dense1P7BConfig",
    "Qwen3Dense32BConfig",
    "Qwen3Dense4BConfig",
    "Qwen3Dense8BConfig",
    "Qwen3DenseConfig",
]
