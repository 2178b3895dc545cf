"""The model seam: configs, model bodies, HF checkpoint I/O and the registry."""

from xtl.model.base import BaseModel, CheckpointMismatchError, TransformerConfig
from xtl.model.dense import *  # noqa: F403
from xtl.model.dense import __all__ as _dense_all
from xtl.model.moe import *  # noqa: F403
from xtl.model.moe import __all__ as _moe_all
from xtl.model.output import ModelOutput
from xtl.model.registry import (
    ALIASES,
    MODEL_TYPES,
    alias_names,
    get_model_config,
    get_model_config_from_hf,
    register_alias,
    register_display_alias,
    register_model_type,
)
from xtl.model.sequence import SequenceContext

__all__ = [
    "ALIASES",
    "MODEL_TYPES",
    "BaseModel",
    "CheckpointMismatchError",
    "ModelOutput",
    "SequenceContext",
    "TransformerConfig",
    "alias_names",
    "get_model_config",
    "get_model_config_from_hf",
    "register_alias",
    "register_display_alias",
    "register_model_type",
    *_dense_all,
    *_moe_all,
]
