"""Export HF safetensors directories during and at the end of training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from xtl.model.hf import DEFAULT_MAX_SHARD_SIZE, FP8_FORMATS, copy_side_files
from xtl.utils import resolve_path


class HFExport(pl.Callback):
    """Write ``save_hf`` directories every ``every_n_steps`` optimizer steps and when training ends.

    Under FSDP every rank takes part (each parameter is gathered once, one at a time) and rank 0 writes, so the
    full model never sits on every rank. The tokenizer of the datamodule is copied into each export so the
    directory loads with ``AutoTokenizer`` and ``AutoModelForCausalLM``.

    Args:
        dirpath: Export root (default ``<trainer.default_root_dir>/hf``); exports go to ``step_<N>`` and ``final``.
        every_n_steps: Export period in optimizer steps (0: only at the end).
        at_end: Export when training ends.
        max_shard_size: Shard size bound with a unit, e.g. ``"5GB"`` (the default) or ``"4GiB"``.
        dtype: Dtype of the exported tensors (default: the model config's dtype, else the parameters').
        fp8: ``blockwise`` writes the large linear weights as 128x128 block-quantized fp8 with ``_scale_inv``
            scales and a ``quantization_config`` (the format of ``xtl convert to-fp8``, DeepSeek-V3 and
            Qwen3-FP8 releases); ``null`` (default) writes every tensor in ``dtype``.

    Raises:
        ValueError: ``fp8`` is not ``null`` or ``blockwise``.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_steps: int = 0,
        at_end: bool = True,
        max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
        dtype: str | None = None,
        fp8: str | None = None,
    ) -> None:
        if fp8 is not None and fp8 not in FP8_FORMATS:
            raise ValueError(f"HFExport fp8 must be null or one of {FP8_FORMATS}; got {fp8!r}")
        self.dirpath = dirpath
        self.every_n_steps = every_n_steps
        self.at_end = at_end
        self.max_shard_size = max_shard_size
        self.dtype = dtype
        self.fp8 = fp8
        self.exported: list[Path] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Export every ``every_n_steps`` steps."""
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0:
            self.export(trainer, pl_module, f"step_{step}")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Export the final model."""
        if self.at_end:
            self.export(trainer, pl_module, "final")

    def export(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> Path:
        """Export now to ``<dirpath>/<name>`` and return the path."""
        root = Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "hf"
        target = root / name
        dtype = getattr(torch, self.dtype) if self.dtype else None
        pl_module.model.save_hf(target, max_shard_size=self.max_shard_size, dtype=dtype, fp8=self.fp8)
        tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer_path", None)
        if trainer.is_global_zero and tokenizer:
            copy_side_files(resolve_path(tokenizer), target)
        trainer.strategy.barrier()
        self.exported.append(target)
        return target
