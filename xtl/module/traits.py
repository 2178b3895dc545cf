"""What a building block declares to the model's checkpoint, initialization and sharding code.

:class:`xtl.model.BaseModel` walks its modules and asks each one through these classes: a module takes part by
subclassing one of them, never by carrying an attribute the model probes for by name.

- :class:`SelfInitializing`: initializes its own parameters (:meth:`~SelfInitializing.init_param`).
- :class:`AdapterModule`: parameters that are xtl's own (no HF key; e.g. LoRA's factors).
- :class:`KeepsFp32`: tensors kept in fp32 whatever the model dtype (:attr:`~KeepsFp32.keep_fp32`).
- :class:`FusesProjections`: children that hold several HF projections stacked (:attr:`~FusesProjections.fused_parts`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class SelfInitializing(ABC):
    """A module that initializes its own parameters under ``BaseModel.init_weights`` (and, for an adapter, after
    every load)."""

    @abstractmethod
    def init_param(self, attr: str, tensor: torch.Tensor, std: float) -> None:
        """Fill ``tensor``, the full value of this module's parameter ``attr`` (on CPU, seeded by its name).

        Args:
            attr: The parameter's name in this module (``weight``, ``bias``, ...).
            tensor: Its full tensor, to fill in place.
            std: The model's ``initializer_range``.
        """


class AdapterModule(SelfInitializing):
    """A module whose parameters are not part of the HF model (LoRA's factors): no HF key, left out of
    ``BaseModel.checkpoint_tensors``, initialized by :meth:`init_param` after every load or initialization."""


class KeepsFp32:
    """A module whose tensors named in :attr:`keep_fp32` stay fp32 whatever the training dtype (they are written
    in fp32 and kept out of a ``param_dtype`` cast, e.g. DeepSeek-V3's router weight and correction bias)."""

    keep_fp32: ClassVar[tuple[str, ...]] = ()


class FusesProjections:
    """A module that may hold several HF projections in one child (one matmul).

    Attributes:
        fused_parts: ``{child: ((part, rows), ...)}``, set by the module's ``__init__``: the child ``qkv_proj``
            stacks the rows of ``q_proj``, ``k_proj`` and ``v_proj`` on dim 0, each part under its own HF key
            (``BaseModel.fused_param_parts``). Empty when the module keeps its projections apart.
    """

    fused_parts: dict[str, tuple[tuple[str, int], ...]]


__all__ = ["AdapterModule", "FusesProjections", "KeepsFp32", "SelfInitializing"]
