"""Lightning's ``ModelCheckpoint`` whose ``last`` checkpoint is always the newest state of the run."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint


class ModelCheckpoint(LightningModelCheckpoint):
    """``lightning.pytorch.callbacks.ModelCheckpoint`` (same arguments), with ``save_last`` kept up to date.

    Lightning writes ``last.ckpt`` only when another checkpoint is saved (every ``every_n_train_steps``, at a
    validation), so a run that ends between two saves -- ``max_steps`` not a multiple of ``every_n_train_steps`` --
    leaves a ``last.ckpt`` of an earlier step, and evaluation, export or resume from ``last`` would silently use
    it. This class also saves ``last`` when a fit ends at a step that no checkpoint holds yet.
    """

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save ``last`` when the fit's final step is not saved yet."""
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        else:
            super().on_train_end(trainer, pl_module)
