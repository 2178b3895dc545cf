"""LightningModule of dense causal LMs."""

from __future__ import annotations

from xtl.train.base import LanguageModule


class CausalLM(LanguageModule):
    """Pretraining and SFT of dense decoder-only models (Llama, Qwen2, Qwen3); see :class:`LanguageModule`."""
