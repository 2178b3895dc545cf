"""The model seam: configs, model bodies, HF checkpoint I/O and the registry.

The families (``xtl.model.dense``, ``xtl.model.moe``) are imported on first use of one of their names or of the
registry, so importing ``xtl.model`` (or ``xtl.batch``) does not load every model and transformers' modeling code.
"""

from __future__ import annotations

import importlib
from typing import Any

from xtl.batch import ModelOutput, SequenceContext
from xtl.model.base import BaseModel, TextModel
from xtl.model.config import TransformerConfig
from xtl.model.hf.errors import CheckpointMismatchError
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

_FAMILIES = ("xtl.model.dense", "xtl.model.moe")


def __getattr__(name: str) -> Any:
    """Resolve a family's public name (e.g. ``Qwen3DenseConfig``) by importing the family on first use."""
    for family in _FAMILIES:
        module = importlib.import_module(family)
        if name in module.__all__:
            return getattr(module, name)
    raise AttributeError(f"module 'xtl.model' has no attribute {name!r}")


__all__ = [
    "ALIASES",
    "MODEL_TYPES",
    "BaseModel",
    "CheckpointMismatchError",
    "ModelOutput",
    "SequenceContext",
    "TextModel",
    "TransformerConfig",
    "alias_names",
    "get_model_config",
    "get_model_config_from_hf",
    "register_alias",
    "register_display_alias",
    "register_model_type",
]
