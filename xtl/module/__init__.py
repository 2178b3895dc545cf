"""Model building blocks: attention, rotary, norms, MLPs, decoder layers."""

from xtl.module.attention import MultiHeadAttention
from xtl.module.decoder_layer import DecoderLayer
from xtl.module.mlp import GatedMLP
from xtl.module.norm import RMSNorm
from xtl.module.rope import RopeConfig, RotaryEmbedding

__all__ = ["DecoderLayer", "GatedMLP", "MultiHeadAttention", "RMSNorm", "RopeConfig", "RotaryEmbedding"]
