"""A progress bar that counts optimizer steps: ``step 120/1000``, loss, tokens/s and the time left."""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from xtl.train.step import is_logged_step


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting optimizer steps towards ``max_steps`` instead of batches of an epoch.

    xtl trains by steps (one batch is one optimizer step, and epochs are an artefact of the sampler), so the bar
    reads ``train 120/1000 [01:02<07:38, loss=1.93, tok/s=3.1e+03]``: the step, the steps to go, the elapsed and
    remaining time, the training loss and the throughput. It keeps one bar across epochs and resumes at the
    checkpoint's step. Validation bars are Lightning's.

    Args:
        refresh_rate: Update the bar every ``refresh_rate`` steps.
    """

    def __init__(self, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)

    def init_train_tqdm(self) -> Tqdm:
        """One bar for the whole run, from the (resumed) step to ``max_steps``, drawn first as ``train``."""
        trainer = self.trainer
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        return Tqdm(
            desc="train",
            total=total,
            initial=trainer.global_step,
            unit="step",
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        """Keep the run's bar (no per-epoch reset)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        """Advance to the current optimizer step; show loss and tokens/s on the steps the loggers write.

        Reading a metric waits for the device, so on the other steps only the step count moves.
        """
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        last = bar.total is not None and trainer.global_step >= bar.total
        if trainer.global_step % self.refresh_rate == 0 or last:
            bar.n = trainer.global_step
            if is_logged_step(trainer):
                bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            if last:  # drawn once, ending its line before Lightning says why the fit stopped
                bar.close()
            else:
                bar.refresh()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep the bar open across epochs."""

    def on_train_end(self, *_: Any) -> None:
        """Close the run's bar."""
        if self.train_progress_bar is not None:
            self.train_progress_bar.close()

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The progress-bar metrics without Lightning's logger version (``v_num``)."""
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
