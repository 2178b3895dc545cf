"""xtl: a Lightning-based modular trainer for Hugging Face causal language models."""

from xtl._quiet import silence_third_party_noise

__version__ = "0.1.0"

silence_third_party_noise()
