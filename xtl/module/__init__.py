"""Model building blocks: attention (MHA/GQA, MLA, sinks), rotary, norms, MLPs, routers, experts, decoder layers."""

from xtl.module.attention import MultiHeadAttention
from xtl.module.decoder_layer import DecoderLayer
from xtl.module.dispatcher import Dispatched, LocalDispatcher, MoEDispatcher
from xtl.module.experts import ClampedSwiGLUExperts, GroupedExperts
from xtl.module.mla import MultiLatentAttention
from xtl.module.mlp import GatedMLP
from xtl.module.moe_block import MoEBlock, MoEDecoderLayer
from xtl.module.mtp import MTPBlock
from xtl.module.norm import RMSNorm
from xtl.module.rope import RopeConfig, RotaryEmbedding
from xtl.module.router import NoAuxTopKRouter, Router, RouterOutput, SoftmaxTopKRouter, TopKSoftmaxRouter
from xtl.module.sink_attention import SinkAttention

__all__ = [
    "ClampedSwiGLUExperts",
    "DecoderLayer",
    "Dispatched",
    "GatedMLP",
    "GroupedExperts",
    "LocalDispatcher",
    "MoEBlock",
    "MoEDecoderLayer",
    "MoEDispatcher",
    "MTPBlock",
    "MultiHeadAttention",
    "MultiLatentAttention",
    "NoAuxTopKRouter",
    "RMSNorm",
    "RopeConfig",
    "RotaryEmbedding",
    "Router",
    "RouterOutput",
    "SinkAttention",
    "SoftmaxTopKRouter",
    "TopKSoftmaxRouter",
]
