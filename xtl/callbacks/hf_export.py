"""Export HF safetensors directories during and at the end of training."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from xtl.callbacks._run import run_datamodule
from xtl.callbacks._startup import check_writable_folder
from xtl.errors import ConfigError
from xtl.model import BaseModel
from xtl.model.hf import DEFAULT_MAX_SHARD_SIZE, FP8_FORMATS, copy_side_files
from xtl.strategies.parallelize import HFExportRequest, ModelTransform
from xtl.train.generation import special_token_ids
from xtl.utils import resolve_path


class HFExport(pl.Callback):
    """Write ``save_hf`` directories every ``every_n_steps`` optimizer steps and when training ends.

    Under FSDP every rank takes part (each parameter is gathered once, one at a time) and rank 0 writes, so the
    full model never sits on every rank. The tokenizer of the datamodule is copied into each export so the
    directory loads with ``AutoTokenizer`` and ``AutoModelForCausalLM``, and its special-token ids (the chat
    template's end-of-turn token first among the EOS ids) go into ``config.json`` and ``generation_config.json``,
    so transformers' ``generate`` stops where ``xtl generate`` stops.

    A model transform that changes what an export is writes it instead
    (:meth:`~xtl.strategies.parallelize.ModelTransform.export_hf`): :class:`~xtl.callbacks.LoRA` writes merged
    weights, a PEFT adapter or both, as its ``export`` says.

    Args:
        dirpath: Export root (default ``<trainer.default_root_dir>/hf``); exports go to ``step_<N>`` and ``final``.
        every_n_steps: Export period in optimizer steps (0: only at the end).
        at_end: Export when training ends.
        max_shard_size: Shard size bound with a unit, e.g. ``"5GB"`` (the default) or ``"4GiB"``.
        dtype: Dtype of the exported tensors (default: each tensor loaded from an HF checkpoint in the dtype that
            checkpoint stored it in; the others in the model config's dtype, else their parameter's).
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

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse two model transforms that would both write the export, and an export root that cannot be
        written (before training, not when the first export is due)."""
        _export_writer(trainer)
        if stage == "fit":
            check_writable_folder(trainer, self.root(trainer), "HFExport.dirpath")

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
        """Export now to ``<dirpath>/<name>`` and return the path (every rank must call this)."""
        target = self.root(trainer) / name
        dtype = getattr(torch, self.dtype) if self.dtype else None
        model: BaseModel = pl_module.model
        token_ids = _token_ids(trainer)

        def write_model(path: Path, transform: Callable[[str, torch.Tensor], torch.Tensor] | None) -> None:
            model.save_hf(
                path, self.max_shard_size, dtype, fp8=self.fp8, tensor_transform=transform, token_ids=token_ids
            )

        writer = _export_writer(trainer)
        written = writer.export_hf(model, HFExportRequest(target, dtype, write_model)) if writer else None
        if written is None:
            write_model(target, None)
            written = [target]
        datamodule = run_datamodule(trainer)
        tokenizer = datamodule.tokenizer_path if datamodule is not None else None
        if trainer.is_global_zero and tokenizer:
            for out_dir in written:
                copy_side_files(resolve_path(tokenizer), out_dir)
        trainer.strategy.barrier()
        self.exported.append(target)
        return target

    def root(self, trainer: pl.Trainer) -> Path:
        """The export root: ``dirpath``, or ``<trainer.default_root_dir>/hf``."""
        return Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "hf"


def _export_writer(trainer: pl.Trainer) -> ModelTransform | None:
    """The run's model transform that writes exports itself (one at most), if any."""
    writers = [
        cb for cb in trainer.callbacks
        if isinstance(cb, ModelTransform) and type(cb).export_hf is not ModelTransform.export_hf
    ]  # fmt: skip
    if len(writers) > 1:
        names = ", ".join(type(cb).__name__ for cb in writers)
        raise ConfigError(f"HFExport: {names} each write the HF export their own way; keep one of them")
    return writers[0] if writers else None


def _token_ids(trainer: pl.Trainer) -> dict[str, Any] | None:
    """Special-token ids of the datamodule's tokenizer and chat template (``None`` without a datamodule)."""
    datamodule = run_datamodule(trainer)
    if datamodule is None:
        return None
    return special_token_ids(datamodule.load_tokenizer(), datamodule.template)
