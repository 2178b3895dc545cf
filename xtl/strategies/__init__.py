"""Scale: FSDP2 strategy and atomic checkpoint I/O."""

from xtl.strategies.checkpoint_io import AtomicCheckpointIO
from xtl.strategies.fsdp import FSDPStrategy

__all__ = ["AtomicCheckpointIO", "FSDPStrategy"]
