"""Loggers: Lightning's CSV logger writing its file on its own cadence."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.utilities import rank_zero_only


class CSVLogger(LightningCSVLogger):
    """Lightning's ``CSVLogger`` that appends to ``metrics.csv`` every ``flush_logs_every_n_steps`` steps, after
    every checkpoint and at the end of the run, and not after every logged step.

    Lightning's trainer asks each logger to save after every logging call, so its own CSV logger reopens and appends
    to the file on every logged step whatever ``flush_logs_every_n_steps`` says. Rows wait in memory here instead.
    A crash loses at most the rows since the last write, and since every checkpoint writes them, a run resumed from
    its last checkpoint logs the missing steps again. Takes Lightning's arguments.

    Args:
        save_dir: Save directory.
        name: Experiment name (``None``: no sub-directory).
        version: Experiment version (``None``: the next free one).
        prefix: Prefix of every metric key.
        flush_logs_every_n_steps: Steps between two writes of the file.
    """

    def __init__(
        self,
        save_dir: str,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 50,
    ) -> None:
        super().__init__(save_dir, name, version, prefix, flush_logs_every_n_steps)
        self._written_step = -1
        self._write_next = False

    @rank_zero_only
    def save(self) -> None:
        """Write the waiting rows once they span ``flush_logs_every_n_steps`` steps."""
        rows = self.experiment.metrics
        due = not rows or rows[-1].get("step", 0) - self._written_step >= self._flush_logs_every_n_steps
        if due or self._write_next:
            self._write_next = False
            self.flush()

    @rank_zero_only
    def flush(self) -> None:
        """Write the waiting rows (and the hyperparameters) now."""
        rows = self.experiment.metrics
        if rows:
            self._written_step = int(rows[-1].get("step", self._written_step))
        LightningCSVLogger.save(self)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Write what is left at the end of the run."""
        if self._experiment is not None:
            self.flush()

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Write the rows up to the checkpoint now, and the checkpoint step's own row (logged after the checkpoint
        callback ran) at the next save, so a run resumed from it has every earlier row."""
        super().after_save_checkpoint(checkpoint_callback)
        self.flush()
        self._write_next = True
