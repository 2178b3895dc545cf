"""The training seam: one LightningModule per model family on a shared base."""

from xtl.train.base import LanguageModule
from xtl.train.causal_lm import CausalLM
from xtl.train.model_spec import resolve_model_config
from xtl.train.moe_causal_lm import MoECausalLM
from xtl.train.optim import AdamWConfig, OptimizerConfig, ScheduleConfig
from xtl.train.vision_lm import VisionLM, VisionMoELM
from xtl.utils import resolve_path

__all__ = [
    "AdamWConfig",
    "CausalLM",
    "LanguageModule",
    "MoECausalLM",
    "OptimizerConfig",
    "ScheduleConfig",
    "VisionLM",
    "VisionMoELM",
    "resolve_model_config",
    "resolve_path",
]
