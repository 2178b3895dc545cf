"""Configs of the vision-language (compose) family: a vision tower config plus an xtl text config.

Field names equal transformers' (``Qwen3VLConfig`` / ``Qwen3VLMoeConfig`` and their ``vision_config`` /
``text_config``), so :meth:`Qwen3VLConfig.from_hf_config` and :attr:`Qwen3VLConfig.hf_config` are inverses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from transformers import PretrainedConfig
from transformers import Qwen3VLConfig as HFQwen3VLConfig
from transformers import Qwen3VLMoeConfig as HFQwen3VLMoeConfig
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig

from xtl.model.dense.qwen3 import Qwen3DenseConfig
from xtl.model.moe.qwen3_moe import Qwen3MoEConfig

if TYPE_CHECKING:
    from xtl.model.compose.qwen3_vl import Qwen3VL


@dataclass
class Qwen3VLVisionConfig:
    """The vision tower of Qwen3-VL (transformers' ``Qwen3VLVisionConfig`` field names)."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list[int] = field(default_factory=lambda: [8, 16, 24])
    initializer_range: float = 0.02
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_theta": 10000.0, "rope_type": "axial"})

    @property
    def rope_theta(self) -> float:
        """Base wavelength of the 2-D rotary."""
        return float(self.rope_parameters["rope_theta"])

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig) -> Qwen3VLVisionConfig:
        """Read the fields of a transformers vision config."""
        kwargs = {f.name: getattr(hf_config, f.name) for f in dataclasses.fields(cls) if hasattr(hf_config, f.name)}
        kwargs["deepstack_visual_indexes"] = list(kwargs.get("deepstack_visual_indexes", []))
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``vision_config`` dict transformers expects."""
        return dataclasses.asdict(self)


@dataclass
class Qwen3VLTextDenseConfig(Qwen3DenseConfig):
    """The Qwen3 language model of Qwen3-VL (``model_type='qwen3_vl_text'``), with interleaved M-RoPE."""

    hf_config_class = Qwen3VLTextConfig
    hf_architecture = "Qwen3VLTextModel"

    def build(self):  # noqa: ANN201 - returns xtl.model.compose.qwen3_vl.Qwen3VLText
        """Build the text model (a :class:`xtl.model.dense.Dense` with M-RoPE and DeepStack injection)."""
        from xtl.model.compose.qwen3_vl import Qwen3VLText

        return Qwen3VLText(self)


@dataclass
class Qwen3VLMoeTextMoEConfig(Qwen3MoEConfig):
    """The Qwen3-MoE language model of Qwen3-VL-MoE (``model_type='qwen3_vl_moe_text'``); top-k always renormalized."""

    hf_config_class = Qwen3VLMoeTextConfig
    hf_architecture = "Qwen3VLMoeTextModel"
    hf_extra_fields = ()

    norm_topk_prob: bool = True

    def build(self):  # noqa: ANN201 - returns xtl.model.compose.qwen3_vl.Qwen3VLMoeText
        """Build the text model (a :class:`xtl.model.moe.MoE` with M-RoPE and DeepStack injection)."""
        from xtl.model.compose.qwen3_vl import Qwen3VLMoeText

        return Qwen3VLMoeText(self)


@dataclass
class Qwen3VLConfig:
    """Qwen3-VL (``model_type='qwen3_vl'``): a vision tower, a patch merger and a Qwen3 language model.

    Attributes:
        text_config: The xtl language-model config (its ``tie_word_embeddings`` is the top-level one).
        vision_config: The vision tower.
        text_tie_word_embeddings: ``text_config.tie_word_embeddings`` as transformers stores it (kept for the round
            trip; the top-level ``tie_word_embeddings`` decides tying).
        hf_key_mapping: Regex remaps applied to HF keys after ``to_hf_key_list``.
        fused_projections: The language model's ``fused_projections`` (set on either, it applies to both).
    """

    hf_config_class: ClassVar[type[PretrainedConfig]] = HFQwen3VLConfig
    hf_architecture: ClassVar[str] = "Qwen3VLForConditionalGeneration"
    text_config_class: ClassVar[type] = Qwen3VLTextDenseConfig

    text_config: Any = None
    vision_config: Qwen3VLVisionConfig = field(default_factory=Qwen3VLVisionConfig)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    text_tie_word_embeddings: bool | None = None
    dtype: str | None = None
    hf_key_mapping: dict[str, str] = field(default_factory=dict)
    fused_projections: bool = False

    def __post_init__(self) -> None:
        if self.text_config is None:
            self.text_config = self.text_config_class()
        if isinstance(self.text_config, dict):
            self.text_config = self.text_config_class(**self.text_config)
        if isinstance(self.vision_config, dict):
            self.vision_config = Qwen3VLVisionConfig(**self.vision_config)
        self.text_config.tie_word_embeddings = self.tie_word_embeddings
        self.fused_projections = self.text_config.fused_projections = (
            self.fused_projections or self.text_config.fused_projections
        )

    vision_language: ClassVar[bool] = True
    per_layer_fields: ClassVar[tuple[str, ...]] = ()

    @property
    def routed_experts(self) -> bool:
        """Whether the language model has mixture-of-experts layers."""
        return self.text_config.routed_experts

    @property
    def placeholder_token_ids(self) -> dict[str, int]:
        """The image, video and vision start / end token ids, by their field name."""
        return {
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
        }

    @property
    def language_config(self) -> Any:
        """The language model's config (``text_config``)."""
        return self.text_config

    @property
    def mtp_layers(self) -> int:
        """The language model's multi-token-prediction depths."""
        return self.text_config.mtp_layers

    @property
    def router_aux_loss_coef(self) -> float:
        """0: xtl trains a vision-language model's routers without the balance loss unless
        ``routing.balance_loss_coef`` sets it (the language model's ``router_aux_loss_coef`` is kept for the HF round
        trip only)."""
        return 0.0

    @property
    def model_type(self) -> str:
        """transformers' ``model_type`` of this family."""
        return self.hf_config_class.model_type

    @property
    def initializer_range(self) -> float:
        """The language model's ``initializer_range`` (used by ``init_weights``)."""
        return self.text_config.initializer_range

    @property
    def vocab_size(self) -> int:
        """The language model's vocabulary size."""
        return self.text_config.vocab_size

    @property
    def hidden_size(self) -> int:
        """The language model's width."""
        return self.text_config.hidden_size

    @classmethod
    def from_hf(cls, hf_path: str | Path) -> Qwen3VLConfig:
        """Read ``config.json`` of an HF model directory."""
        return cls.from_hf_config(cls.hf_config_class.from_pretrained(str(hf_path)))

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig) -> Qwen3VLConfig:
        """Map a transformers VLM config onto this class."""
        if hf_config.model_type != cls.hf_config_class.model_type:
            raise ValueError(
                f"{cls.__name__} reads model_type {cls.hf_config_class.model_type!r}, got {hf_config.model_type!r}"
            )
        text = cls.text_config_class.from_hf_config(hf_config.text_config)
        dtype = hf_config.dtype
        return cls(
            text_config=text,
            vision_config=Qwen3VLVisionConfig.from_hf_config(hf_config.vision_config),
            image_token_id=hf_config.image_token_id,
            video_token_id=hf_config.video_token_id,
            vision_start_token_id=hf_config.vision_start_token_id,
            vision_end_token_id=hf_config.vision_end_token_id,
            tie_word_embeddings=hf_config.tie_word_embeddings,
            text_tie_word_embeddings=getattr(hf_config.text_config, "tie_word_embeddings", None),
            dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        )

    @property
    def hf_config(self) -> PretrainedConfig:
        """The transformers config equivalent to this one (inverse of :meth:`from_hf_config`)."""
        text = self.text_config.hf_config
        text.architectures = None
        if self.text_tie_word_embeddings is not None:
            text.tie_word_embeddings = self.text_tie_word_embeddings
        config = self.hf_config_class(
            text_config=text.to_dict(),
            vision_config=self.vision_config.to_hf_dict(),
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            vision_start_token_id=self.vision_start_token_id,
            vision_end_token_id=self.vision_end_token_id,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        config.architectures = [self.hf_architecture]
        if self.dtype is not None:
            config.dtype = self.dtype
        return config

    def build(self) -> Qwen3VL:
        """Build the model (a plain ``nn.Module``; works under ``torch.device('meta')``)."""
        from xtl.model.compose.qwen3_vl import Qwen3VL

        return Qwen3VL(self)


@dataclass
class Qwen3VLMoeConfig(Qwen3VLConfig):
    """Qwen3-VL-MoE (``model_type='qwen3_vl_moe'``): the Qwen3-VL vision tower and a Qwen3-MoE language model."""

    hf_config_class: ClassVar[type[PretrainedConfig]] = HFQwen3VLMoeConfig
    hf_architecture: ClassVar[str] = "Qwen3VLMoeForConditionalGeneration"
    text_config_class: ClassVar[type] = Qwen3VLMoeTextMoEConfig


__all__ = [
    "Qwen3VLConfig",
    "Qwen3VLMoeConfig",
    "Qwen3VLMoeTextMoEConfig",
    "Qwen3VLTextDenseConfig",
    "Qwen3VLVisionConfig",
]
