"""Config base of the dense family: structural switches each model family sets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from xtl.model.config import TransformerConfig
from xtl.module.norm import RMSNorm


@dataclass
class DenseConfig(TransformerConfig):
    """A dense decoder-only config. Families override the structural properties below, never the body."""

    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def qkv_bias(self) -> bool:
        """Bias on the q/k/v projections."""
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        """Bias on the attention output projection."""
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm on queries and keys."""
        return False

    @property
    def attention_sinks(self) -> bool:
        """A learned sink logit per head joins the attention softmax (GPT-OSS)."""
        return False

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek): the family config then carries the MLA dimensions."""
        return False

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has routed experts (never, for a dense model)."""
        return False

    @property
    def norm_class(self) -> type[RMSNorm]:
        """RMSNorm variant of the decoder-layer and final norms."""
        return RMSNorm

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """Sliding window of layer ``layer_idx`` (``None``: full attention)."""
        return None

    def build(self):  # noqa: ANN201 - returns xtl.model.dense.Dense
        """Build the dense model."""
        from xtl.model.dense.dense import Dense

        return Dense(self)


@dataclass
class SlidingWindowMixin:
    """Qwen-style per-layer attention types (``layer_types``) with an optional sliding window."""

    per_layer_fields: ClassVar[tuple[str, ...]] = ("layer_types",)

    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.use_sliding_window:
            self.sliding_window = None
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention"
                if self.sliding_window is not None and i >= self.max_window_layers
                else "full_attention"
                for i in range(self.num_hidden_layers)
            ]

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window for layers typed ``sliding_attention``."""
        if self.layer_types is not None and self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None
