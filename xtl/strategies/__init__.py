"""The scale & speed seam: the ordered parallelize contract, the FSDP2 strategy and atomic checkpoint I/O.

The public names are imported on first use, so that ``xtl.strategies.layout`` (plain sizes, read by ``xtl memory``)
loads without Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AtomicCheckpointIO": "xtl.strategies.checkpoint_io",
    "ContextParallelFeature": "xtl.strategies.capability",
    "FSDPStrategy": "xtl.strategies.fsdp",
    "ModelTransform": "xtl.strategies.parallelize",
    "ParallelizingStrategy": "xtl.strategies.parallelize",
    "Refusal": "xtl.strategies.capability",
    "ShardedStrategyMixin": "xtl.strategies.parallelize",
    "SingleDevice": "xtl.strategies.parallelize",
    "TransformStage": "xtl.strategies.parallelize",
    "WeightSource": "xtl.strategies.parallelize",
}

__all__ = [
    "AtomicCheckpointIO",
    "ContextParallelFeature",
    "FSDPStrategy",
    "ModelTransform",
    "ParallelizingStrategy",
    "Refusal",
    "ShardedStrategyMixin",
    "SingleDevice",
    "TransformStage",
    "WeightSource",
]

if TYPE_CHECKING:
    from xtl.strategies.capability import ContextParallelFeature, Refusal
    from xtl.strategies.checkpoint_io import AtomicCheckpointIO
    from xtl.strategies.fsdp import FSDPStrategy
    from xtl.strategies.parallelize import (
        ModelTransform,
        ParallelizingStrategy,
        ShardedStrategyMixin,
        SingleDevice,
        TransformStage,
        WeightSource,
    )


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'xtl.strategies' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
