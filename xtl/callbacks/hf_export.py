"""Export HF safetensors directories during and at the end of training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from xtl.callbacks._run import run_datamodule
from xtl.callbacks.lora import LoRA
from xtl.errors import ConfigError
from xtl.model import BaseModel
from xtl.model.hf import DEFAULT_MAX_SHARD_SIZE, FP8_FORMATS, copy_side_files
from xtl.model.hf.peft_adapter import merge_lora_transform, peft_module_paths, peft_target_modules, save_peft_adapter
from xtl.module.lora import lora_layers
from xtl.train.generation import special_token_ids
from xtl.utils import resolve_path

LORA_EXPORTS = ("merged", "adapter", "both")


class HFExport(pl.Callback):
    """Write ``save_hf`` directories every ``every_n_steps`` optimizer steps and when training ends.

    Under FSDP every rank takes part (each parameter is gathered once, one at a time) and rank 0 writes, so the
    full model never sits on every rank. The tokenizer of the datamodule is copied into each export so the
    directory loads with ``AutoTokenizer`` and ``AutoModelForCausalLM``, and its special-token ids (the chat
    template's end-of-turn token first among the EOS ids) go into ``config.json`` and ``generation_config.json``,
    so transformers' ``generate`` stops where ``xtl generate`` stops.

    A model with LoRA adapters (:class:`~xtl.callbacks.LoRA`) is exported as ``lora`` says: ``merged`` writes the
    HF model with each adapted weight replaced by ``W + scaling * B @ A`` (fp32 math, then the export dtype);
    ``adapter`` writes a PEFT adapter directory instead (``adapter_config.json`` + ``adapter_model.safetensors``,
    loadable with ``peft.PeftModel.from_pretrained`` on the base model); ``both`` writes the merged model with the
    adapter in its ``adapter`` subdirectory. Without adapters ``lora`` has no effect.

    Args:
        dirpath: Export root (default ``<trainer.default_root_dir>/hf``); exports go to ``step_<N>`` and ``final``.
        every_n_steps: Export period in optimizer steps (0: only at the end).
        at_end: Export when training ends.
        max_shard_size: Shard size bound with a unit, e.g. ``"5GB"`` (the default) or ``"4GiB"``.
        dtype: Dtype of the exported tensors (default: the model config's dtype, else the parameters').
        fp8: ``blockwise`` writes the large linear weights as 128x128 block-quantized fp8 with ``_scale_inv``
            scales and a ``quantization_config`` (the format of ``xtl convert to-fp8``, DeepSeek-V3 and
            Qwen3-FP8 releases); ``null`` (default) writes every tensor in ``dtype``.
        lora: ``merged`` (default), ``adapter`` or ``both`` (see above). The adapter factors keep their parameter
            dtype unless ``dtype`` is set.

    Raises:
        ValueError: ``fp8`` is not ``null`` or ``blockwise``, or ``lora`` is not one of the three.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_steps: int = 0,
        at_end: bool = True,
        max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
        dtype: str | None = None,
        fp8: str | None = None,
        lora: str = "merged",
    ) -> None:
        if fp8 is not None and fp8 not in FP8_FORMATS:
            raise ValueError(f"HFExport fp8 must be null or one of {FP8_FORMATS}; got {fp8!r}")
        if lora not in LORA_EXPORTS:
            raise ConfigError(f"HFExport lora must be one of {LORA_EXPORTS}; got {lora!r}")
        self.dirpath = dirpath
        self.every_n_steps = every_n_steps
        self.at_end = at_end
        self.max_shard_size = max_shard_size
        self.dtype = dtype
        self.fp8 = fp8
        self.lora = lora
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
        """Export now to ``<dirpath>/<name>`` and return the path (every rank must call this)."""
        root = Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "hf"
        target = root / name
        dtype = getattr(torch, self.dtype) if self.dtype else None
        model: BaseModel = pl_module.model
        adapted = next(lora_layers(model), None) is not None
        written = []
        if not adapted or self.lora in ("merged", "both"):  # the transform is None without adapters
            merge = merge_lora_transform(model)
            token_ids = _token_ids(trainer)
            model.save_hf(
                target, self.max_shard_size, dtype, fp8=self.fp8, tensor_transform=merge, token_ids=token_ids
            )
            written.append(target)
        if adapted and self.lora in ("adapter", "both"):
            adapter_dir = target / "adapter" if self.lora == "both" else target
            config = _adapter_config(trainer, model)
            save_peft_adapter(model, adapter_dir, config, source_dir=model.source_dir, dtype=dtype)
            written.append(adapter_dir)
        datamodule = run_datamodule(trainer)
        tokenizer = datamodule.tokenizer_path if datamodule is not None else None
        if trainer.is_global_zero and tokenizer:
            for out_dir in written:
                copy_side_files(resolve_path(tokenizer), out_dir)
        trainer.strategy.barrier()
        self.exported.append(target)
        return target


def _token_ids(trainer: pl.Trainer) -> dict[str, Any] | None:
    """Special-token ids of the datamodule's tokenizer and chat template (``None`` without a datamodule)."""
    datamodule = run_datamodule(trainer)
    if datamodule is None:
        return None
    return special_token_ids(datamodule.load_tokenizer(), datamodule.template)


def _adapter_config(trainer: pl.Trainer, model: BaseModel) -> dict[str, Any]:
    """``adapter_config.json`` of the model's adapters: from the trainer's LoRA callback, else from the layers."""
    targets = peft_target_modules(model, peft_module_paths(model))
    lora = next((cb for cb in trainer.callbacks if isinstance(cb, LoRA)), None)
    if lora is None:
        ranks = {layer.lora_A.out_features for _, layer in lora_layers(model)}
        scalings = {layer.lora_scaling for _, layer in lora_layers(model)}
        if len(ranks) != 1 or len(scalings) != 1:
            raise ConfigError("HFExport lora: adapters of different ranks or scalings cannot share one PEFT config")
        (rank,), (scaling,) = ranks, scalings
        lora = LoRA(rank=rank, alpha=scaling * rank)
    return lora.adapter_config(targets)
