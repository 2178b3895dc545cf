"""MoE model family: Qwen3-MoE, DeepSeek-V3, GPT-OSS."""

from xtl.model.moe.config import MoEConfig
from xtl.model.moe.deepseek_v3 import DeepSeekV3, DeepSeekV3_671BConfig, DeepSeekV3Config
from xtl.model.moe.gpt_oss import GptOss, GptOss20BConfig, GptOss120BConfig, GptOssMoEConfig
from xtl.model.moe.moe import MoE
from xtl.model.moe.qwen3_moe import Qwen3MoE30BA3Config, Qwen3MoE235BA22Config, Qwen3MoEConfig

__all__ = [
    "DeepSeekV3",
    "DeepSeekV3Config",
    "DeepSeekV3_671BConfig",
    "GptOss",
    "GptOss120BConfig",
    "GptOss20BConfig",
    "GptOssMoEConfig",
    "MoE",
    "MoEConfig",
    "Qwen3MoE235BA22Config",
    "Qwen3MoE30BA3Config",
    "Qwen3MoEConfig",
]
