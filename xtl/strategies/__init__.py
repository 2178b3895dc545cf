"""The scale & speed seam: the ordered parallelize contract, the FSDP2 strategy and atomic checkpoint I/O."""

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
