"""Vision-language (compose) family: Qwen3-VL and Qwen3-VL-MoE."""

from xtl.model.compose.config import (
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
    Qwen3VLMoeTextMoEConfig,
    Qwen3VLTextDenseConfig,
    Qwen3VLVisionConfig,
)
from xtl.model.compose.qwen3_vl import Qwen3VL, Qwen3VLMoeText, Qwen3VLText

__all__ = [
    "Qwen3VL",
    "Qwen3VLConfig",
    "Qwen3VLMoeConfig",
    "Qwen3VLMoeText",
    "Qwen3VLMoeTextMoEConfig",
    "Qwen3VLText",
    "Qwen3VLTextDenseConfig",
    "Qwen3VLVisionConfig",
]
