"""QLoRA as a config fragment: NF4 base weights for the adapters of the run's ``LoRA`` callback."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from xtl.callbacks.lora import LoRA
from xtl.errors import ConfigError
from xtl.model import BaseModel
from xtl.module.nf4 import QUANTIZE_BASE, quantize_base_weights
from xtl.strategies.parallelize import ModelTransform, TransformStage


class QLoRA(pl.Callback, ModelTransform):
    """Store the frozen base weights of the LoRA-adapted layers in NF4 once they are loaded (QLoRA).

    Once the weights are loaded (:meth:`after_weights`), the frozen base weights of the adapted layers are stored in
    4-bit NF4 (:mod:`xtl.module.nf4`, torchao's ``NF4Tensor``, about 4.13 bits per weight) and dequantized to the
    compute dtype in each matmul; the adapters keep the parameter dtype. Layers whose weight NF4 cannot store
    (element count not a multiple of 16384) stay in their dtype, with a note. A callback of its own, so that
    ``callbacks/qlora.yaml`` composes with ``callbacks/lora.yaml``; the run needs exactly one
    :class:`~xtl.callbacks.LoRA` callback.

    Under :class:`~xtl.strategies.FSDPStrategy` (FSDP2, with expert or context parallelism and HSDP too) the NF4
    weights are sharded like the others (FSDP QLoRA): each weight, loaded into its shards, is quantized whole as one
    process quantizes it and every rank keeps the NF4 rows of its shard, which FSDP all-gathers as NF4 for each
    forward and backward; the adapters are sharded, reduced and optimized like any trained parameter. A layer whose
    rows do not split evenly over the shard ranks into whole blocks of 64 weights stays in its dtype, with the
    reason (:mod:`xtl.module.nf4`). ``param_dtype: bfloat16`` dequantizes the gathered NF4 weight to bf16 in each
    matmul, as ``bf16-mixed`` autocast does on one device. FSDP's ``cpu_offload`` is refused (not built).

    Args:
        quantize_base: The 4-bit format: ``nf4``.
        quantize_all_linear: Quantize every frozen linear layer except the LM head, not only the adapted ones.
    """

    transform_stage = TransformStage.MODEL

    def __init__(self, quantize_base: str = "nf4", quantize_all_linear: bool = False) -> None:
        if quantize_base not in QUANTIZE_BASE:
            raise ConfigError(f"QLoRA.quantize_base must be one of {QUANTIZE_BASE}, got {quantize_base!r}")
        self.quantize_base = quantize_base
        self.quantize_all_linear = quantize_all_linear

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check the run before any weight is loaded: one LoRA callback, no FSDP CPU offload."""
        loras = [cb for cb in trainer.callbacks if isinstance(cb, LoRA)]
        if len(loras) != 1:
            raise ConfigError(
                f"QLoRA quantizes the base weights of LoRA adapters: the run needs one LoRA callback, it has "
                f"{len(loras)} (add --config callbacks/lora.yaml before callbacks/qlora.yaml)"
            )
        if pl_module.parallelizer.offloads_parameters:
            raise ConfigError(
                "QLoRA under FSDP quantizes the sharded weights on the training device; with "
                "trainer.strategy.init_args.cpu_offload they live on the CPU, which is not built yet: remove "
                "cpu_offload (the NF4 weights take about an eighth of bf16 ones)"
            )

    def transform_model(self, model: BaseModel) -> BaseModel:
        """Nothing to do on the meta model: the weights are quantized once loaded."""
        return model

    def memory_settings(self) -> dict[str, Any]:
        """NF4 base weights (of the adapted layers, or of every linear layer), for ``xtl memory --config``."""
        return {"qlora": True, "qlora_all_linear": self.quantize_all_linear}

    def after_weights(self, model: BaseModel) -> BaseModel:
        """Store the loaded frozen base weights in NF4 (:func:`xtl.module.nf4.quantize_base_weights`; sharded
        weights: on every rank, each keeping its shard)."""
        head = model.text_model().lm_head
        rank_zero_info(quantize_base_weights(model, self.quantize_all_linear, head))
        return model
