"""Throughput and model-FLOPs utilization logging."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl

from xtl.model.dims import ModelDims


class Throughput(pl.Callback):
    """Log ``train/tflops_per_device`` and ``train/mfu`` from the step's real tokens and the model's FLOPs/token.

    FLOPs per token are :meth:`xtl.model.dims.ModelDims.flops_per_token` of the module's ``model_config`` at the
    step's longest sequence: 6 x activated non-embedding parameters (top-k routed experts only for MoE) plus the
    attention score/value FLOPs (MLA with its own query/key and value head widths).

    Args:
        peak_tflops: The device's peak dense TFLOP/s for the training dtype (``None``: MFU not logged).
    """

    def __init__(self, peak_tflops: float | None = None) -> None:
        self.peak_tflops = peak_tflops
        self._start = 0.0
        self._dims: tuple[Any, ModelDims] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Start the step clock."""
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log achieved TFLOP/s per device (and MFU)."""
        seconds = max(time.perf_counter() - self._start, 1e-9)
        tokens = sum(mb.num_real_tokens for mb in batch)
        seq = max((mb.seq_ctx.seq_len for mb in batch), default=0)
        tflops = tokens * self.flops_per_token(pl_module.model_config, seq) / seconds / 1e12
        metrics = {"train/tflops_per_device": tflops}
        if self.peak_tflops:
            metrics["train/mfu"] = tflops / self.peak_tflops
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def flops_per_token(self, config: Any, seq_len: int) -> float:
        """Training FLOPs per token of ``config`` at ``seq_len`` (dimensions read once per config object).

        Args:
            config: The module's xtl model config.
            seq_len: Tokens per sequence.

        Returns:
            FLOPs per token.
        """
        if self._dims is None or self._dims[0] is not config:
            self._dims = (config, ModelDims.from_config(config))
        return self._dims[1].flops_per_token(seq_len)
