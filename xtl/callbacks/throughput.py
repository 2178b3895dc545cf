"""Throughput and model-FLOPs utilization logging."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from xtl.model.dims import ModelDims, VisionDims
from xtl.train.step import StepWindow, is_logged_step


class Throughput(pl.Callback):
    """Log ``train/tflops_per_device`` and ``train/mfu`` from the real tokens and the model's FLOPs/token.

    Rates are taken on the steps the loggers write, over the window since the previous one (the device is waited
    for once per window, not once per step).

    FLOPs per token are :meth:`xtl.model.dims.ModelDims.flops_per_token` of the module's ``model_config`` at the
    step's longest sequence: 6 x activated non-embedding parameters (top-k routed experts only for MoE) plus the
    attention score/value FLOPs (MLA with its own query/key and value head widths). A vision-language model adds
    :meth:`xtl.model.dims.VisionDims.flops_per_image` for every image of the step.

    Args:
        peak_tflops: The device's peak dense TFLOP/s for the training dtype (``None``: MFU not logged).
    """

    def __init__(self, peak_tflops: float | None = None) -> None:
        self.peak_tflops = peak_tflops
        self._window = StepWindow()
        self._flops = 0.0
        self._dims: tuple[Any, ModelDims] | None = None
        self._grids: list[Any] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the first window."""
        self._window, self._flops, self._grids = StepWindow(), 0.0, []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count the step's FLOPs; on logged steps, log achieved TFLOP/s per device (and MFU) over the window."""
        tokens = sum(mb.num_real_tokens for mb in batch)
        seq = max((mb.seq_ctx.pack_len for mb in batch), default=0)  # attention spans the pack, cp shares too
        config = pl_module.model_config
        self._flops += tokens * self.flops_per_token(config, seq)
        grids = [mb.seq_ctx.extras.get("image_grid_thw") for mb in batch]
        self._grids += [grid for grid in grids if grid is not None]  # read on logged steps (no host sync here)
        self._window.add(tokens)
        if not is_logged_step(trainer):
            return
        _, seconds, _ = self._window.close(pl_module.device)
        if self._grids:
            vision = VisionDims.from_config(pl_module.model_config)
            self._flops += sum(vision.flops_per_image(*image) for grid in self._grids for image in grid.tolist())
            self._grids = []
        tflops, self._flops = self._flops / seconds / 1e12, 0.0
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
