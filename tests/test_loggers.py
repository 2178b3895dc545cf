"""xtl's CSV logger: Lightning's rows and file, written on its own cadence rather than on every logged step."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
from lightning.fabric.loggers.csv_logs import _ExperimentWriter
from lightning.pytorch.demos.boring_classes import BoringModel

from xtl.loggers import CSVLogger


class _Logged(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("train/loss", out["loss"])
        return out


def _fit(tmp_path, monkeypatch, logger, steps: int, **trainer_kwargs) -> list[int]:
    """Fit a boring model for ``steps`` steps logging every step; returns the last logged step at each write."""
    writes: list[int] = []
    save = _ExperimentWriter.save

    def counted(writer):
        if writer.metrics:
            writes.append(int(writer.metrics[-1]["step"]))
        return save(writer)

    monkeypatch.setattr(_ExperimentWriter, "save", counted)
    trainer = pl.Trainer(
        max_steps=steps,
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    trainer.fit(_Logged())
    return writes


def _rows(logger) -> list[dict]:
    with open(f"{logger.log_dir}/metrics.csv") as file:
        return list(csv.DictReader(file))


class TestCSVLogger:
    def test_writes_every_n_steps_and_at_the_end_with_every_row(self, tmp_path, monkeypatch):
        logger = CSVLogger(tmp_path, flush_logs_every_n_steps=5)
        writes = _fit(tmp_path, monkeypatch, logger, 12, enable_checkpointing=False)
        assert writes == [4, 9, 11], writes  # Lightning's own logger writes after each of the 12 steps
        assert [int(r["step"]) for r in _rows(logger)] == list(range(12))

    def test_lightning_logger_writes_every_step(self, tmp_path, monkeypatch):
        """The control: what the trainer does with Lightning's CSV logger (the cost xtl's avoids)."""
        from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger

        writes = _fit(tmp_path, monkeypatch, LightningCSVLogger(tmp_path), 6, enable_checkpointing=False)
        assert writes == list(range(6)), writes

    def test_every_checkpoint_writes_the_rows_up_to_it(self, tmp_path, monkeypatch):
        logger = CSVLogger(tmp_path, flush_logs_every_n_steps=100)
        checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
        writes = _fit(tmp_path, monkeypatch, logger, 7, callbacks=[checkpoint])
        assert writes == [1, 2, 4, 5, 6], writes  # up to the checkpoint, then its step's row
        assert [int(r["step"]) for r in _rows(logger)] == list(range(7))
