"""A test-only callback that kills a rank (or its whole simulated node) by SIGKILL once, at the start of a step.

Added to a run with ``--trainer.callbacks+='{"class_path": "tests.cli.kill_rank.KillRankOnce", ...}'`` (the
repository root on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class KillRankOnce(pl.Callback):
    """SIGKILL global rank ``rank`` when step ``step`` starts, on the first attempt only.

    Args:
        step: The ``global_step`` at whose first batch the rank dies (the steps before it are done and logged).
        rank: The global rank that dies (``None``: every rank of the run the callback is given to).
        node: Kill the rank's launcher too (its parent process: a torchrun agent), as a dead node loses both.
        marker: A file created before the kill: with it, "first attempt" means "the file does not exist yet" (a
            replacement node's agent counts its restarts from 0); without it, ``TORCHELASTIC_RESTART_COUNT`` is 0.
    """

    def __init__(self, step: int, rank: int | None = 1, node: bool = False, marker: str | None = None) -> None:
        self.step = step
        self.rank = rank
        self.node = node
        self.marker = marker

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        """Die here when this is the rank, the step and the first attempt."""
        if self.rank not in (None, trainer.global_rank) or trainer.global_step != self.step:
            return
        if not self._first_attempt():
            return
        if self.marker is not None:
            Path(self.marker).write_text(f"{os.getpid()}\n")
        if self.node:
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def _first_attempt(self) -> bool:
        if self.marker is not None:
            return not Path(self.marker).exists()
        return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
