"""What a callback reads of the run it is part of, typed (no attribute probing)."""

from __future__ import annotations

import lightning.pytorch as pl

from xtl.data import XTLDataModule


def run_datamodule(trainer: pl.Trainer) -> XTLDataModule | None:
    """The trainer's datamodule when it is xtl's (``None`` for a run without one, or with another kind)."""
    datamodule = trainer.datamodule
    return datamodule if isinstance(datamodule, XTLDataModule) else None
