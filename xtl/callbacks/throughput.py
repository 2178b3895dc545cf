"""Throughput and model-FLOPs utilization logging."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl


class Throughput(pl.Callback):
    """Log ``train/tflops_per_device`` and ``train/mfu`` from the step's real tokens and the model's FLOPs/token.

    FLOPs per token = 6 x (non-embedding parameters) + 12 x layers x hidden x sequence (attention scores and
    values, forward + backward), the usual dense-transformer estimate.

    Args:
        peak_tflops: The device's peak dense TFLOP/s for the training dtype (``None``: MFU not logged).
    """

    def __init__(self, peak_tflops: float | None = None) -> None:
        self.peak_tflops = peak_tflops
        self._start = 0.0

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
        tflops = tokens * flops_per_token(pl_module.model_config, seq) / seconds / 1e12
        metrics = {"train/tflops_per_device": tflops}
        if self.peak_tflops:
            metrics["train/mfu"] = tflops / self.peak_tflops
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token of a dense decoder (6N + attention)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    head_dim = config.resolved_head_dim
    attn = h * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    mlp = 3 * h * config.intermediate_size
    head = h * config.vocab_size
    params = layers * (attn + mlp) + head
    return 6.0 * params + 12.0 * layers * config.num_attention_heads * head_dim * seq_len / 2
