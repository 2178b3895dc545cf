"""The training seam: one LightningModule per model family on a shared base."""

from xtl.train.base import LanguageModule
from xtl.train.causal_lm import CausalLM
from xtl.train.model_spec import resolve_model_config, resolve_path
from xtl.train.moe_causal_lm import MoECausalLM

__all__ = ["CausalLM", "LanguageModule", "MoECausalLM", "resolve_model_config", "resolve_path"]
