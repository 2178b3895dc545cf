"""Lightning's ``ModelCheckpoint`` whose ``last`` checkpoint is always the newest state of the run."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint

from xtl.strategies.checkpoint_io import recover_interrupted_replace


class TrainingCheckpoint(LightningModelCheckpoint):
    """``lightning.pytorch.callbacks.ModelCheckpoint`` (same arguments), with ``save_last`` kept up to date.

    (Its own name, so that a config naming Lightning's class by its short name ``ModelCheckpoint`` stays
    unambiguous.)

    Lightning writes ``last.ckpt`` only when another checkpoint is saved (every ``every_n_train_steps``, at a
    validation), so a run that ends between two saves -- ``max_steps`` not a multiple of ``every_n_train_steps`` --
    leaves a ``last.ckpt`` of an earlier step, and evaluation, export or resume from ``last`` would silently use
    it. This class also saves ``last`` when a fit ends at a step that no checkpoint holds yet.

    ``--ckpt_path last`` first finishes a distributed checkpoint replacement that a crash interrupted
    (:func:`xtl.strategies.checkpoint_io.recover_interrupted_replace`), so ``last`` is never lost.
    """

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save ``last`` when the fit's final step is not saved yet."""
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        else:
            super().on_train_end(trainer, pl_module)

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        if self.dirpath is not None:
            recover_interrupted_replace(Path(self.dirpath))
        return super()._find_last_checkpoints(trainer)
