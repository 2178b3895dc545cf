"""Check during training that the model still computes what transformers computes (:mod:`xtl.model.parity`)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from xtl.callbacks._startup import check_writable_folder
from xtl.model.parity import (
    PARITY_MODES,
    ParityCheckError,
    ParityDocuments,
    ParityReport,
    resolve_tolerance,
    run_parity_check,
)
from xtl.strategies.capability import ContextParallelFeature, Refusal
from xtl.strategies.layout import broadcast_object
from xtl.utils import atomic_write_bytes

_ON_FAIL = ("raise", "warn")
_DTYPES = ("float32", "bfloat16", "float16")


class HFParityCheck(pl.Callback, ContextParallelFeature):
    """Compare the run's model with transformers' eager model on a real micro-batch of the run.

    At the first training batch of a fit (weights loaded or initialized, before the first optimizer step) and,
    with ``every_n_steps``, at the start of every N-th step, the transformers model is built from the run's own
    ``hf_config`` and filled with the run's current weights through the HF key map (under FSDP every rank gathers
    one tensor at a time, rank 0 keeps them). Rank 0's first micro-batch (at most ``max_tokens`` tokens) is run
    by both models, each document on its own for the reference, and hidden states after every decoder layer,
    logits, loss and the gradients of ``grad_params`` are compared (see :mod:`xtl.model.parity`).

    A vision-language model (Qwen3-VL, Qwen3-VL-MoE) is compared with transformers'
    ``Qwen3VL(Moe)ForConditionalGeneration``: the documents keep their images from the micro-batch (a cut at
    ``max_tokens`` never splits an image; a micro-batch without an image gets a probe document with one random
    image), and the vision tower's rows (patch embedding, every block, merger, DeepStack mergers) come first.

    Rank 0 prints the per-layer table, writes ``<dirpath>/step_<n>.json`` and logs ``parity/max_abs_logits``,
    ``parity/max_rel_grad``, ``parity/loss_abs_diff`` and ``parity/ok``. A check over its tolerance raises
    :class:`~xtl.model.parity.ParityCheckError` naming the first diverging layer (``on_fail: warn`` warns and
    continues). The check leaves weights, gradients, optimizer and RNG states untouched.

    Args:
        every_n_steps: Also check at the start of every N-th optimizer step (0: only at the start of the fit).
        at_start: Check at the first training batch of the fit.
        mode: ``hf_impl``: the xtl model runs with transformers' exact ops (the HF-parity selectors of
            ``xtl.ops.hf_impl``, switched on for the check only) and the reference's call shapes, in the
            parameters' dtype without the run's autocast (``bf16-mixed`` runs are checked in fp32); bitwise
            equality is expected. ``fast``: the run's own ops on the packed micro-batch, compared with the bounds
            of the compute dtype.
        tolerance: ``auto`` (``bitwise`` for ``hf_impl``; ``bf16`` or ``fp32`` by compute dtype for ``fast``) or
            a preset: ``bitwise``, ``fp32``, ``bf16``, ``fp8`` (fp8 training against the bf16 reference).
        tolerances: Bounds replacing the preset's: ``hidden``, ``logits``, ``loss``, ``grad``.
        grad_params: Glob patterns of xtl parameter names whose gradients are compared (default: first and last
            decoder layer, final norm, head, and a vision-language model's first vision block and patch merger;
            ``[]``: forward only).
        max_tokens: Tokens of the micro-batch the check uses.
        max_layers: Compare only the first decoder layers (the reference then holds only those; logits, loss and
            gradients are not compared).
        dtype: Reference dtype (default: the run's compute dtype).
        on_fail: ``raise`` or ``warn``.
        dirpath: Where the JSON reports go (default ``<trainer.default_root_dir>/parity``).
    """

    def __init__(
        self,
        every_n_steps: int = 0,
        at_start: bool = True,
        mode: str = "hf_impl",
        tolerance: str = "auto",
        tolerances: dict[str, float] | None = None,
        grad_params: list[str] | None = None,
        max_tokens: int = 512,
        max_layers: int | None = None,
        dtype: str | None = None,
        on_fail: str = "raise",
        dirpath: str | None = None,
    ) -> None:
        if mode not in PARITY_MODES:
            raise ValueError(f"HFParityCheck.mode must be one of {PARITY_MODES}, got {mode!r}")
        try:
            resolve_tolerance(tolerance, mode, torch.float32, tolerances)
        except ValueError as err:
            raise ValueError(f"HFParityCheck.{err}") from None
        if on_fail not in _ON_FAIL:
            raise ValueError(f"HFParityCheck.on_fail must be one of {_ON_FAIL}, got {on_fail!r}")
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"HFParityCheck.dtype must be one of {_DTYPES} or null, got {dtype!r}")
        for key, value, least in (("every_n_steps", every_n_steps, 0), ("max_tokens", max_tokens, 1)):
            if value < least:
                raise ValueError(f"HFParityCheck.{key} must be >= {least}, got {value}")
        if max_layers is not None and max_layers < 1:
            raise ValueError(f"HFParityCheck.max_layers must be >= 1 or null, got {max_layers}")
        self.every_n_steps = every_n_steps
        self.at_start = at_start
        self.mode = mode
        self.tolerance = tolerance
        self.tolerances = tolerances
        self.grad_params = grad_params
        self.max_tokens = max_tokens
        self.max_layers = max_layers
        self.dtype = dtype
        self.on_fail = on_fail
        self.dirpath = dirpath
        self.reports: list[ParityReport] = []
        self._started = False

    def context_parallel_refusal(self, stage: str) -> Refusal | None:
        """Refused under context parallelism: the check runs whole documents on each process."""
        return Refusal(
            "HFParityCheck runs whole documents on each process",
            "drop HFParityCheck from trainer.callbacks: callbacks/parity_check.yaml",
        )

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a report folder that cannot be written (before training, not when the first report is due)."""
        if stage == "fit":
            check_writable_folder(trainer, self.root(trainer), "HFParityCheck.dirpath")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Check before this step's update when it is the fit's first batch or an N-th step."""
        step = trainer.global_step
        first = not self._started
        self._started = True
        due = self.every_n_steps and step > 0 and step % self.every_n_steps == 0
        if (first and self.at_start) or due:
            self.check(trainer, pl_module, batch[0] if batch else None)

    def check(self, trainer: pl.Trainer, pl_module: pl.LightningModule, micro_batch: Any) -> ParityReport | None:
        """Run one check on rank 0's ``micro_batch`` (every rank must call); returns the report on rank 0.

        Raises:
            ParityCheckError: On every rank, when a bound is exceeded and ``on_fail`` is ``raise``.
        """
        group = pl_module.parallelizer.world_group()  # every rank of the layout runs the (sharded) model
        documents = None
        if trainer.is_global_zero and micro_batch is not None:
            config = pl_module.model_config
            vision = {}
            if config.vision_language:  # the pack's images go to their documents
                vision = dict(
                    image_token_id=config.image_token_id,
                    spatial_merge_size=config.vision_config.spatial_merge_size,
                )
            documents = ParityDocuments.from_packed(micro_batch.seq_ctx, micro_batch.labels, self.max_tokens, **vision)
        documents = broadcast_object(documents, group)
        if documents is None:
            return None
        step = trainer.global_step
        report = run_parity_check(
            pl_module.model,
            documents,
            hf_config=pl_module.model_config.hf_config,
            mode=self.mode,
            tolerance=self._tolerance(trainer, pl_module),
            tolerances=self.tolerances,
            grad_params=self.grad_params,
            max_layers=self.max_layers,
            dtype=getattr(torch, self.dtype) if self.dtype else None,
            # hf_impl keeps its own precision (the parameters' dtype, no autocast): bitwise needs the same ops
            forward_context=trainer.precision_plugin.forward_context if self.mode == "fast" else None,
        )
        message = ""
        if report is not None:
            report.step = step
            self.reports.append(report)
            self._publish(trainer, report)
            message = report.failure_message()
        message = broadcast_object(message, group)
        if message:
            if self.on_fail == "raise":
                raise ParityCheckError(message, report)
            if trainer.is_global_zero:
                warnings.warn(message, stacklevel=1)
        return report

    def root(self, trainer: pl.Trainer) -> Path:
        """The report folder: ``dirpath``, or ``<trainer.default_root_dir>/parity``."""
        return Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "parity"

    # ---- private ---------------------------------------------------------------------------------------------

    def _tolerance(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        """``auto`` in ``fast`` mode under 16-bit autocast is the bf16 preset (the reference may be fp32); in
        ``hf_impl`` mode under FSDP with a 16-bit ``param_dtype`` it is ``bitwise_forward`` (gradients are summed
        over the documents in ``reduce_dtype``), and under expert parallelism too (every rank sends its copy of
        the documents' tokens to each expert, whose weight gradient then sums twice the rows in another order:
        measured 1e-7 relative in fp32)."""
        if self.tolerance != "auto":
            return self.tolerance
        if self.mode == "fast" and "16-mixed" in str(trainer.precision):
            return "bf16"
        parallelizer = pl_module.parallelizer
        sixteen_bit = parallelizer.gathered_dtype in (torch.bfloat16, torch.float16)
        if self.mode == "hf_impl" and (sixteen_bit or parallelizer.layout.ep > 1):
            return "bitwise_forward"
        return self.tolerance

    def _publish(self, trainer: pl.Trainer, report: ParityReport) -> None:
        atomic_write_bytes(self.root(trainer) / f"step_{report.step}.json", report.to_json().encode())
        rank_zero_info(report.render())
        for logger in trainer.loggers:
            logger.log_metrics(report.metrics(), step=report.step)
