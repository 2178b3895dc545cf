"""The config base of every xtl model family: shared decoder-only fields and the HF config round trip."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import PretrainedConfig

from xtl.module.rope import RopeConfig

if TYPE_CHECKING:
    from xtl.model.base import BaseModel

# Config fields that are xtl's own: never read from or written to a transformers config by name.
_XTL_ONLY_FIELDS = {"rope", "attn_impl", "hf_key_mapping", "fused_projections", "num_labels"}
# transformers' names a causal-LM class and its sequence-classification sibling end with
CAUSAL_LM_SUFFIX = "ForCausalLM"
SEQUENCE_CLASSIFICATION_SUFFIX = "ForSequenceClassification"


@dataclass
class TransformerConfig:
    """Fields shared by every decoder-only model. Subclasses add their family's fields.

    Field names equal transformers' config field names wherever the meaning is the same, so that
    :meth:`from_hf` and :attr:`hf_config` are exact inverses by construction.

    Attributes:
        attn_impl: xtl attention implementation: ``auto``, ``eager``, ``sdpa`` or ``flash``.
        rope: Rotary settings (transformers' ``rope_parameters``).
        hf_key_mapping: Regex remaps applied to HF keys after ``to_hf_key_list`` (e.g. a text tower inside a VLM).
        fused_projections: One matmul for the q/k/v projections of each attention and for the gate/up projections
            of each gated MLP (dense layers and shared experts), with weights concatenated at load and split again
            on save (the HF checkpoint keeps the separate projections). Under the HF-parity switch each part is still
            its own matmul, bitwise equal to transformers; Muon orthogonalizes each part on its own.
        num_labels: Outputs of a sequence-classification head in place of the LM head (transformers'
            ``*ForSequenceClassification``: ``score``, read at a sequence's last token; 1 for a reward model); 0, the
            default, is the causal LM with its vocabulary head. Read from and written to a transformers config only
            with a ``*ForSequenceClassification`` architecture (transformers gives every config a ``num_labels``).
    """

    hf_config_class: ClassVar[type[PretrainedConfig]]
    hf_architecture: ClassVar[str]
    routed_experts: ClassVar[bool] = False  # the family has mixture-of-experts layers
    vision_language: ClassVar[bool] = False  # the family has a vision tower
    per_layer_fields: ClassVar[tuple[str, ...]] = ()  # fields with one entry per decoder layer (e.g. layer_types)

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    attn_impl: str = "auto"
    hf_key_mapping: dict[str, str] = field(default_factory=dict)
    fused_projections: bool = False
    num_labels: int = 0

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if isinstance(self.rope, dict):
            self.rope = RopeConfig(**self.rope)
        if isinstance(self.dtype, torch.dtype):
            self.dtype = str(self.dtype).removeprefix("torch.")

    @property
    def model_type(self) -> str:
        """transformers' ``model_type`` of this family."""
        return self.hf_config_class.model_type

    @property
    def sequence_classification_architecture(self) -> str:
        """transformers' ``*ForSequenceClassification`` class of this family (its causal-LM class's sibling)."""
        return self.hf_architecture.removesuffix(CAUSAL_LM_SUFFIX) + SEQUENCE_CLASSIFICATION_SUFFIX

    @property
    def resolved_head_dim(self) -> int:
        """``head_dim`` or ``hidden_size // num_attention_heads``."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    # Traits every family has, with the value of a family that lacks the feature; a family with it declares a field
    # of the same name (DeepSeek-V3's ``mtp_layers``, Qwen3-MoE's ``router_aux_loss_coef``).

    @property
    def mtp_layers(self) -> int:
        """Multi-token-prediction depths the model builds and trains (0: none)."""
        return 0

    @property
    def router_aux_loss_coef(self) -> float:
        """Weight of the routers' load-balancing loss when ``routing.balance_loss_coef`` is unset (0: none)."""
        return 0.0

    @property
    def placeholder_token_ids(self) -> dict[str, int]:
        """The ids of the tokens that stand for an image or a video, by their field name (none in a text model)."""
        return {}

    @property
    def language_config(self) -> TransformerConfig:
        """The config of the language model: this one (a vision-language config returns its ``text_config``)."""
        return self

    @classmethod
    def from_hf(cls, hf_path: str | Path) -> TransformerConfig:
        """Read ``config.json`` of an HF model directory (through transformers' own config class)."""
        return cls.from_hf_config(cls.hf_config_class.from_pretrained(str(hf_path)))

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig) -> TransformerConfig:
        """Map a transformers config onto this class; fields absent from old checkpoints keep their defaults."""
        if hf_config.model_type != cls.hf_config_class.model_type:
            raise ValueError(
                f"{cls.__name__} reads model_type {cls.hf_config_class.model_type!r}, got {hf_config.model_type!r}"
            )
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in _XTL_ONLY_FIELDS and hasattr(hf_config, f.name):
                kwargs[f.name] = getattr(hf_config, f.name)
        kwargs["rope"] = RopeConfig.from_hf_config(hf_config)
        architectures = hf_config.architectures or []
        if any(name.endswith(SEQUENCE_CLASSIFICATION_SUFFIX) for name in architectures):
            kwargs["num_labels"] = hf_config.num_labels
        return cls(**kwargs)

    @property
    def hf_config(self) -> PretrainedConfig:
        """The transformers config equivalent to this one (inverse of :meth:`from_hf_config`)."""
        hf_fields = {f.name for f in dataclasses.fields(self.hf_config_class)}
        kwargs = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name in hf_fields and f.name not in _XTL_ONLY_FIELDS
        }
        kwargs["rope_parameters"] = self.rope.to_hf()
        config = self.hf_config_class(**kwargs)
        config.architectures = [self.hf_architecture]
        if self.num_labels:
            config.architectures = [self.sequence_classification_architecture]
            config.num_labels = self.num_labels
        if self.dtype is not None:
            config.dtype = self.dtype
        return config

    def build(self) -> BaseModel:
        """Build the model (a plain ``nn.Module``; works under ``torch.device('meta')``)."""
        raise TypeError(f"{type(self).__name__} is abstract; use a model family's config class")


def read_hf_config_dict(hf_path: str | Path) -> dict[str, Any]:
    """Read ``config.json`` of an HF model directory as a dict (clear error when missing or malformed)."""
    path = Path(hf_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {hf_path} a Hugging Face model directory?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from err


__all__ = ["TransformerConfig", "read_hf_config_dict"]
