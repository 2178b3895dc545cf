"""The LightningModule base shared by every model family: one ``training_step`` = one optimizer step."""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
import torchmetrics
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from xtl.data import XTLDataModule
from xtl.data.collate import MicroBatch, collate_pack, split_for_context_parallel
from xtl.data.consumer import DataConsumer
from xtl.data.item import IGNORE_INDEX
from xtl.data.packing import Pack
from xtl.errors import ConfigError, did_you_mean
from xtl.model import BaseModel, ModelOutput
from xtl.strategies.capability import ContextParallelFeature, Refusal
from xtl.strategies.parallelize import ModelTransform, ParallelizingStrategy, SingleDevice, WeightSource
from xtl.train.family import DataRanks, RouterTraining, family_of, family_training
from xtl.train.generation import GenerationConfig, chat_prompt_ids, generate, split_thinking
from xtl.train.model_spec import resolve_model_config
from xtl.train.optim import AdamWConfig, OptimizerConfig, ScheduleConfig
from xtl.train.reference import ReferencePolicy
from xtl.train.scorer import score_tokens
from xtl.train.step import (
    StepResult,
    StepWindow,
    forward_backward,
    grad_norm_and_clip,
    is_logged_step,
    optimizer_step_unless_nonfinite,
)
from xtl.utils import atomic_write_bytes


class LanguageModule(pl.LightningModule, ContextParallelFeature, DataConsumer):
    """Trains an xtl model of any family on step batches (``list[MicroBatch]``) from :class:`xtl.data.XTLDataModule`.

    Manual optimization: each ``training_step`` runs forward/backward on every micro-batch with the loss scaled by
    the global supervised-token count (all-reduced over data-parallel ranks), clips the gradient norm (DTensor
    aware), and steps the optimizer and the scheduler. A non-finite gradient norm skips the step (counted, logged,
    warned) and leaves the weights untouched.

    ``configure_model`` builds the model on ``meta`` and hands it to the strategy's ordered ``parallelize``
    sequence (:mod:`xtl.strategies.parallelize`) together with the model transforms contributed by callbacks; a
    trainer strategy that is not an xtl one gets the single-device sequence. The transforms' consequences come
    with them: checkpoint keys they leave out, and their hooks after each optimizer step.

    The model's family (:mod:`xtl.train.family`: dense, MoE, vision-language) adds its own training behaviour:
    models with routed experts train their routers as ``routing`` says (balance and z losses, the aux-loss-free
    bias update, router metrics); every family names its parts, which ``freeze`` and ``optimizer.lr_scales`` use.

    Args:
        model: HF model directory (config + weights), ``env:VAR``, registered alias, or
            ``{"model_type": ..., <config fields>}`` for a from-scratch model.
        model_overrides: Config fields to replace (e.g. ``{"attn_impl": "sdpa"}``).
        load_weights: Load weights when ``model`` is an HF directory (else initialize).
        optimizer: The optimizer and its settings (default AdamW; see :mod:`xtl.train.optim`).
        schedule: Learning-rate warmup and decay.
        max_grad_norm: Clip the global gradient norm to this (``None``: no clipping, norm still logged).
        seed: Seed of weight initialization.
        param_dtype: Dtype of the parameters without FSDP mixed precision (``float32`` or ``bfloat16``).
        generation: Decoding settings of ``predict`` (greedy by default; the tokenizer's stop tokens are added).
        routing: Router training of models with routed experts (default :class:`~xtl.train.RouterTraining`);
            refused for other models.
        freeze: Model parts to freeze (``requires_grad=False``): ``vision``, ``merger``, ``language`` for a
            vision-language model (``BaseModel.parameter_parts``).

    Multi-token prediction (DeepSeek-V3 ``mtp_layers``) adds its weighted per-depth losses to each micro-batch's
    loss (:class:`~xtl.train.family.MTPLosses`); objectives other than next-token prediction refuse it
    (:attr:`trains_mtp`).

    Under context parallelism the module is one :class:`~xtl.strategies.capability.ContextParallelFeature` of the
    run: the objective declares itself (:meth:`context_parallel_refusal`; next-token training runs), and its parts
    (:meth:`context_parallel_parts`: the decoding of ``predict``, the family's training behaviours) are asked with
    it, once, by the strategy at startup.

    Raises:
        ConfigError: ``routing`` for a model without routed experts; ``freeze`` names an unknown part or all of
            them; ``mtp_layers`` with an objective that does not train it.
    """

    objective: ClassVar[str] = "SFT/pretraining"  # what the module trains, as users name it (in messages)
    trains_mtp: ClassVar[bool] = True  # the objective trains multi-token-prediction depths (next-token training)
    scores_sequences: ClassVar[bool] = False  # the objective trains a sequence-classification head (num_labels)

    def __init__(
        self,
        model: str | dict[str, Any],
        model_overrides: dict[str, Any] | None = None,
        load_weights: bool = True,
        optimizer: OptimizerConfig = AdamWConfig(),
        schedule: ScheduleConfig = ScheduleConfig(),
        max_grad_norm: float | None = 1.0,
        seed: int = 0,
        param_dtype: Literal["float32", "bfloat16"] = "float32",
        generation: GenerationConfig | None = None,
        routing: RouterTraining | None = None,
        freeze: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.model_config, self.hf_dir = resolve_model_config(model, model_overrides)
        self.family = family_of(self.model_config)
        self.family_training = family_training(self.model_config, routing)
        if self.model_config.mtp_layers and not self.trains_mtp:
            raise ConfigError(
                f"mtp_layers: {type(self).__name__} does not train multi-token prediction (a next-token objective "
                "of LanguageModule); set mtp_layers to 0"
            )
        labels = self.model_config.language_config.num_labels
        if labels and not self.scores_sequences:
            raise ConfigError(
                f"model.init_args.model: a sequence-classification model (num_labels {labels}, "
                f"a score head instead of the LM head) does not train with {type(self).__name__}; train it with "
                "xtl.train.RewardModule, or start from a causal LM"
            )
        self.freeze = list(freeze or [])
        self._check_freeze()
        self._transforms: list[ModelTransform] = []
        if not load_weights:
            self.hf_dir = None
        self.optimizer_config = optimizer
        self.schedule = schedule
        self.model: BaseModel | None = None
        self.reference: ReferencePolicy | None = None  # objectives that compare with one set it
        self._skipped = torch.zeros(())
        self._tokens_seen = torch.zeros((), dtype=torch.float64)
        self._skipped_warned = 0
        self._window = StepWindow()
        self.generation = generation or GenerationConfig()
        self._val_metrics = nn.ModuleDict()
        self._test_metrics = nn.ModuleDict()
        self._predictions: list[dict[str, Any]] = []
        self._predict_generator: torch.Generator | None = None

    @property
    def reads_images(self) -> bool:
        """The model has a vision tower (its family's ``vision`` trait): the data module feeds it images."""
        return self.family.vision

    # ---- model -----------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build on meta, then run the strategy's ordered ``parallelize`` sequence (idempotent)."""
        if self.model is not None:
            return
        with torch.device("meta"):
            model = self.model_config.build()
        self._transforms = [cb for cb in self._trainer_callbacks() if isinstance(cb, ModelTransform)]
        weights = WeightSource(self.hf_dir, self.hparams.seed, getattr(torch, self.hparams.param_dtype))
        self.model = self.parallelizer.parallelize(model, self._transforms, weights)
        self._freeze_parts()
        skipped = {f"model.{key}" for t in self._transforms for key in t.skipped_checkpoint_keys(self.model)}
        if self.reference is not None:
            self.reference.build(self)
            skipped |= self.reference.skipped_checkpoint_keys("reference.")
        if skipped:  # e.g. LoRA's base: checkpoints hold the trained weights only, the rest comes from the source
            self.strict_loading = False
            self.register_state_dict_post_hook(partial(_drop_keys, keys=skipped))

    def build_frozen_copy(self, transforms: Sequence[ModelTransform] = ()) -> BaseModel:
        """A frozen copy of the starting policy (a reference model): built from the policy's weights by the same
        ``parallelize`` sequence (sharded like the policy) with ``transforms`` (the run's model transforms that shape
        what the policy computes), without gradient, in eval mode."""
        with torch.device("meta"):
            reference = self.model_config.build()
        weights = WeightSource(self.hf_dir, self.hparams.seed, getattr(torch, self.hparams.param_dtype))
        reference = self.parallelizer.parallelize(reference, list(transforms), weights)
        reference.requires_grad_(False)
        return reference.eval()

    @property
    def model_transforms(self) -> list[ModelTransform]:
        """The model transforms the run's callbacks contribute (found by :meth:`configure_model`)."""
        return list(self._transforms)

    @property
    def parallelizer(self) -> ParallelizingStrategy:
        """The trainer's strategy when it is an xtl one, else the single-device sequence on this module's device."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if isinstance(strategy, ParallelizingStrategy):
            return strategy
        return SingleDevice(strategy.root_device if strategy is not None else "cpu")

    def setup(self, stage: str) -> None:
        """Check that the datamodule's tokenizer fits the model's vocabulary (a clear error instead of an index
        error deep inside the embedding), and give xtl's data module this rank's data-parallel rank and size from
        the layout (the ranks of one context-parallel group read the same data)."""
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        if not isinstance(datamodule, XTLDataModule):
            return
        size = len(datamodule.load_tokenizer())
        if size > self.model_config.vocab_size:
            raise ValueError(
                f"the tokenizer {datamodule.tokenizer_path!r} has {size} tokens but the model's vocab_size is "
                f"{self.model_config.vocab_size}; set model vocab_size >= {size} (or use a matching tokenizer)"
            )
        layout = self.parallelizer.layout
        if layout.world_size != self._trainer.world_size:  # several processes under a strategy that is not xtl's
            raise ConfigError(
                f"trainer.strategy: {type(self._trainer.strategy).__name__} runs {self._trainer.world_size} "
                "processes, but xtl trains several processes only under its own strategies; set trainer.strategy "
                "to xtl.strategies.FSDPStrategy (data parallel, sharded; callbacks and recipes in docs/configs.md)"
            )
        datamodule.use_data_parallel(layout.data_rank(self.global_rank), layout.dp_size)

    def context_parallel_refusal(self, stage: str) -> Refusal | None:
        """The objective's declaration: next-token training, validation and test run under context parallelism.
        An objective that cannot (in some mode) returns why."""
        return None

    def context_parallel_parts(self) -> list[ContextParallelFeature]:
        """What the module brings to a run besides its objective: the decoding of ``predict`` and the family's
        training behaviours (multi-token prediction)."""
        return [_DECODING, *self.family_training]

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """With context parallelism, keep this rank's share of each packed micro-batch (cut on the host, before the
        copy to the device: :func:`~xtl.data.collate.split_for_context_parallel`)."""
        layout = self.parallelizer.layout
        if layout.cp == 1 or not isinstance(batch, list) or not all(isinstance(b, MicroBatch) for b in batch):
            return batch
        rank = layout.context_rank(self.global_rank)
        return [split_for_context_parallel(mb, rank, layout.cp) for mb in batch]

    def forward(self, *args: Any, **kwargs: Any) -> ModelOutput:
        """Call the underlying xtl model."""
        return self.model(*args, **kwargs)

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped for a non-finite gradient norm (reads a device counter)."""
        return int(self._skipped.item())

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped = torch.tensor(float(value), device=self._skipped.device)

    @property
    def tokens_seen(self) -> int:
        """Non-padding training tokens over all data-parallel ranks so far (reads a device counter)."""
        return int(self._tokens_seen.item())

    @tokens_seen.setter
    def tokens_seen(self, value: int) -> None:
        self._tokens_seen = torch.tensor(float(value), dtype=torch.float64, device=self._tokens_seen.device)

    def trainable_parameters(self) -> dict[str, int]:
        """Trainable parameter count per model part (after :meth:`configure_model`)."""
        owner = self.model.parameter_part_of()
        counts = dict.fromkeys(self.model.parameter_parts(), 0)
        for param in self.model.parameters():
            if param.requires_grad:
                counts[owner[id(param)]] += param.numel()
        return counts

    # ---- optimization ----------------------------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        """The configured optimizer over weight-decay groups and a per-step warmup + decay schedule."""
        optimizer = self.optimizer_config.build(self.model, self.device)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.schedule.lr_lambda(self._total_steps()))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch: list[Any], batch_idx: int) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches, without reading device values back on the host.

        A non-finite gradient norm skips the update on the device (found-inf flag, as ``GradScaler`` does); the step
        still counts (``global_step``, the schedule). Skips are counted on the device and warned about on the next
        logged step.
        """

        def forward(mb: MicroBatch) -> ModelOutput:
            return self.model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False)

        result = self.optimizer_step_over(batch, forward, lambda mb: mb.num_tokens)
        self.log_step_metrics({})
        return result.loss_sum / result.global_tokens.clamp(min=1)

    def optimizer_step_over(
        self, batch: list[Any], forward: Callable[[Any], ModelOutput], num_items: Callable[[Any], int]
    ) -> StepResult:
        """Forward and backward over the micro-batches (each adds ``loss_sum / global items``), then clip, step
        (unless the gradient norm is not finite), the family's and transforms' updates, and the step's logging.

        Args:
            batch: This rank's micro-batches.
            forward: The model's output on one micro-batch, with the ``loss_sum`` the objective minimizes.
            num_items: What ``loss_sum`` is normalized by, per micro-batch (supervised tokens, pairs, ...); summed over
                the step's micro-batches and data-parallel ranks.
        """
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        for behaviour in self.family_training:
            behaviour.start_step(len(batch), self.device)
            behaviour.count_step(batch, self._data_ranks())
        result = forward_backward(
            forward=forward,
            micro_batches=batch,
            num_tokens=num_items,
            dp_world_size=self._averaged_ranks(),
            backward=self.manual_backward,
            device=self.device,
            group=self.parallelizer.data_group(),
            extra_loss=self.extra_loss,
            gradient_sync=self._gradient_sync,
        )
        grad_norm = grad_norm_and_clip(list(self.model.parameters()), self.hparams.max_grad_norm)
        found_inf = optimizer_step_unless_nonfinite(optimizer, grad_norm)
        scheduler.step()
        self.after_optimizer_step(result, 1.0 - found_inf)
        optimizer.zero_grad(set_to_none=True)
        self._skipped = self._skipped.to(found_inf.device) + found_inf
        self._log_step(batch, result, grad_norm)
        return result

    def log_step_metrics(self, values: dict[str, torch.Tensor]) -> None:
        """Log an objective's step metrics (``train/...`` keys) with the family's (router statistics)."""
        values = {**values, **{f"train/{k}": v for b in self.family_training for k, v in b.step_metrics().items()}}
        if values:
            self.log_dict(values, on_step=True, on_epoch=False, batch_size=1)

    def on_train_start(self) -> None:
        """Start the throughput window (setup and loading before the first step are not counted)."""
        self._window = StepWindow()

    def on_train_end(self) -> None:
        """Warn about skipped steps not yet reported on a logged step."""
        self._warn_nonfinite()

    def extra_loss(self, output: ModelOutput, global_tokens: torch.Tensor) -> torch.Tensor | None:
        """The family's terms added to a micro-batch's loss (router losses; none for dense models)."""
        terms = [t for b in self.family_training if (t := b.extra_loss(output, self._data_ranks())) is not None]
        return sum(terms[1:], terms[0]) if terms else None

    def after_optimizer_step(self, result: StepResult, applied: torch.Tensor) -> None:
        """After the optimizer step: the family's update (e.g. router biases), then each transform's hook.

        Args:
            result: The step's forward/backward result.
            applied: 1.0 when the update was applied, 0.0 when it was skipped (a device tensor: scale an update by
                it instead of branching on it, which would read it back on the host).
        """
        for behaviour in self.family_training:
            behaviour.after_optimizer_step(self.model, result.outputs, applied, self._data_ranks())
        for transform in self._transforms:
            transform.after_optimizer_step(self.model, applied)
        if self.reference is not None:
            self.reference.after_optimizer_step(self.model, self.global_step)

    # ---- validation, test, predict ---------------------------------------------------------------------------

    def validation_step(self, batch: list[Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Accumulate loss, token count and token accuracy of one eval set (torchmetrics, synced across ranks)."""
        self._eval_step(self._val_metrics, batch, dataloader_idx)

    def on_validation_epoch_end(self) -> None:
        """Log ``val/loss``, ``val/perplexity`` and ``val/token_accuracy`` for each named eval set."""
        self._log_eval_metrics("val", self._val_metrics)

    def test_step(self, batch: list[Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """As :meth:`validation_step`, on a test set."""
        self._eval_step(self._test_metrics, batch, dataloader_idx)

    def on_test_epoch_end(self) -> None:
        """Log ``test/loss``, ``test/perplexity`` and ``test/token_accuracy`` (``test/<name>/...`` for several)."""
        self._log_eval_metrics("test", self._test_metrics)

    def on_predict_epoch_start(self) -> None:
        """Start a predict run: no rows yet, the sampling generator seeded with ``generation.seed``."""
        self._predictions = []
        self._predict_generator = torch.Generator(device=self.device).manual_seed(self.generation.seed)

    def predict_step(self, batch: list[dict[str, Any]], batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        """Answer a batch of prompt rows (:meth:`XTLDataModule.predict_dataloader`) with cached decoding.

        Prompts are rendered with the datamodule's tokenizer and chat template plus a generation prompt; decoding
        uses ``generation`` and stops at the tokenizer's and template's stop tokens.

        Returns:
            One ``{"messages": ..., "output": answer}`` row per prompt (plus ``reasoning`` when the reply opens
            with a non-empty thinking block).
        """
        datamodule = self.trainer.datamodule
        tokenizer = datamodule.load_tokenizer()
        template, template_kwargs = datamodule.template, datamodule.template_kwargs
        config = self.generation.with_tokenizer(tokenizer, template)
        prompts = [chat_prompt_ids(tokenizer, row["prompt"], template, template_kwargs) for row in batch]
        outputs = generate(self.model, prompts, config, self._predict_generator).sequences
        rows = []
        for row, out in zip(batch, outputs):
            text = tokenizer.decode([t for t in out if t not in config.stop_token_ids], skip_special_tokens=False)
            reasoning, answer = split_thinking(text)
            rows.append(
                {"messages": row["messages"], "output": answer, **({"reasoning": reasoning} if reasoning else {})}
            )
        self._predictions.extend(rows)
        return rows

    def on_predict_epoch_end(self) -> None:
        """Write the predictions as JSONL, atomically, to ``data.predict_output`` (default
        ``<default_root_dir>/predictions.jsonl``); rank 0 writes (every rank decodes every prompt)."""
        if not self.trainer.is_global_zero:
            return
        datamodule = self.trainer.datamodule
        output = datamodule.predict_output if isinstance(datamodule, XTLDataModule) else None
        path = Path(output) if output else Path(self.trainer.default_root_dir) / "predictions.jsonl"
        lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in self._predictions)
        atomic_write_bytes(path, lines.encode("utf-8"))
        rank_zero_info(f"xtl predict: wrote {len(self._predictions)} predictions to {path}")

    def eval_micro_batches(self, batch: list[MicroBatch]) -> Iterator[tuple[MicroBatch, bool]]:
        """This rank's micro-batches of an evaluation step, ``(micro-batch, True)``, then ``(filler, False)`` up to
        the most any rank has in the step.

        At the tail of a held-out set ranks get fewer packs (or none); with sharded parameters every forward gathers
        them with collectives, so every rank must run the same number of forwards: the others forward a 2-token
        filler pack without labels, whose output the caller drops.
        """
        target = len(batch)
        group = self.parallelizer.world_group()
        if self.parallelizer.shards_parameters and group is not None:
            most = torch.tensor(float(target), device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
            target = int(most.item())
        yield from ((mb, True) for mb in batch)
        for _ in range(target - len(batch)):
            yield self._filler_micro_batch(), False

    # ---- checkpoint ------------------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store counters that must survive a resume; a run stopped by ``max_steps`` stays mid-epoch."""
        checkpoint["xtl"] = {"skipped_steps": self.skipped_steps, "tokens_seen": self.tokens_seen}
        trainer = self._trainer
        if trainer is not None and 0 < trainer.max_steps <= trainer.global_step:
            _reopen_epoch(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the counters stored by :meth:`on_save_checkpoint`; say so when a resumed fit has nothing left."""
        state = checkpoint.get("xtl", {})
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self._skipped_warned = self.skipped_steps
        trainer, step = self._trainer, int(checkpoint.get("global_step", 0))
        if (
            trainer is not None
            and trainer.state.fn == "fit"
            and 0 < trainer.max_steps <= step
            and trainer.is_global_zero
        ):
            print(
                f"xtl: the checkpoint is at step {step} and trainer.max_steps is {trainer.max_steps}: nothing is left "
                f"to train. To go on, pass a larger --trainer.max_steps (the schedule then spans the new length; "
                f"--model.init_args.schedule.decay_steps {step} keeps the finished one at its final learning rate)",
                file=sys.stderr,
            )

    # ---- private ---------------------------------------------------------------------------------------------

    def _check_freeze(self) -> None:
        parts = self.family.parts
        unknown = [p for p in self.freeze if p not in parts]
        if unknown:
            hint = did_you_mean(unknown[0], parts)
            raise ConfigError(
                f"model.init_args.freeze: a {self.family.name} model has no part {unknown[0]!r}{hint}; its parts are "
                f"{', '.join(parts)}"
            )
        if set(self.freeze) >= set(parts):
            raise ConfigError(f"model.init_args.freeze: {self.freeze} freezes every part; nothing would train")

    def _freeze_parts(self) -> None:
        """``requires_grad=False`` on the parameters of the parts named by ``freeze``."""
        parts = self.model.parameter_parts()
        for part in self.freeze:
            for module in parts[part]:
                module.requires_grad_(False)

    def _data_ranks(self) -> DataRanks:
        return DataRanks(self._averaged_ranks(), self._sum_over_data_ranks)

    def _trainer_callbacks(self) -> list[pl.Callback]:
        return list(self._trainer.callbacks) if self._trainer is not None else []

    def _averaged_ranks(self) -> int:
        """Ranks the gradient reduction averages over: every rank, data- and context-parallel (the ``cp`` ranks of
        a sequence each hold a share of its tokens)."""
        return self.parallelizer.layout.world_size

    def _sum_over_data_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed in place over the ranks of the data group (unchanged on one rank)."""
        group = self.parallelizer.data_group()
        if group is not None:
            dist.all_reduce(tensor, group=group)
        return tensor

    def _gradient_sync(self, enabled: bool) -> None:
        self.parallelizer.set_gradient_sync(self.model, enabled)

    def _total_steps(self) -> int:
        if self.schedule.decay_steps:
            return int(self.schedule.decay_steps)
        trainer = self._trainer
        if trainer is None:
            return 1
        if trainer.max_steps and trainer.max_steps > 0:
            return trainer.max_steps
        try:
            return max(1, int(trainer.estimated_stepping_batches))
        except (RuntimeError, ValueError, TypeError):
            return 1

    def _log_step(self, batch: list[Any], result: StepResult, grad_norm: torch.Tensor) -> None:
        """Log the step from device tensors; values are read on the host only on steps the loggers write.

        ``train/tokens_per_sec`` (logged steps only) is the non-padding tokens of all data-parallel ranks over the
        wall time since the previous logged step.
        """
        real = sum(mb.num_real_tokens for mb in batch)
        host = torch.tensor([real, sum(mb.seq_ctx.seq_len for mb in batch)], dtype=torch.float64)
        stats = torch.cat([result.loss_sum.detach().double().reshape(1), host.to(self.device, non_blocking=True)])
        stats = self._sum_over_data_ranks(stats)
        loss = stats[0] / result.global_tokens.double().clamp(min=1)
        self._tokens_seen = self._tokens_seen.to(stats.device) + stats[1]
        self._window.add(stats[1])
        values = {
            "train/loss": loss.float(),
            "train/grad_norm": grad_norm.float(),
            "train/lr": torch.tensor(self.lr_schedulers().get_last_lr()[0]),
            "train/tokens_seen": self._tokens_seen.float(),
            "train/fill_ratio": (stats[1] / stats[2].clamp(min=1)).float(),
            "train/skipped_steps": self._skipped.float(),
        }
        self.log_dict(values, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)
        self.log("loss", values["train/loss"], prog_bar=True, logger=False, batch_size=1)
        if self._trainer is not None and is_logged_step(self.trainer):
            tokens, seconds, _ = self._window.close(self.device)
            rate = tokens / seconds
            self.log("train/tokens_per_sec", rate, on_step=True, on_epoch=False, batch_size=1)
            self.log("tok/s", rate, prog_bar=True, logger=False, batch_size=1)
            self._warn_nonfinite(loss)

    def _warn_nonfinite(self, loss: torch.Tensor | None = None) -> None:
        """On a logged step (values are read then anyway): warn about new skipped steps and a non-finite loss."""
        skipped = self.skipped_steps
        if skipped > self._skipped_warned:
            warnings.warn(
                f"step {self.global_step}: {skipped - self._skipped_warned} optimizer step(s) skipped since the last "
                f"logged step (non-finite gradient norm; {skipped} skipped so far)",
                stacklevel=2,
            )
            self._skipped_warned = skipped
        if loss is not None and not math.isfinite(float(loss)):
            warnings.warn(f"step {self.global_step}: train/loss is {float(loss)}", stacklevel=2)

    def _eval_step(self, sets: nn.ModuleDict, batch: list[Any], dataloader_idx: int) -> None:
        metrics = self._metrics_for(sets, dataloader_idx)
        for mb, real in self.eval_micro_batches(batch):
            scores = score_tokens(self.model, mb.seq_ctx, mb.labels, greedy=True)
            if not real:
                continue
            metrics["loss_sum"].update(-scores.logps.detach().sum())
            metrics["tokens"].update(scores.scored.sum().float())
            metrics["correct"].update(scores.greedy.sum().float())
        if not batch:  # keep collective calls aligned when a rank has no eval packs left
            for metric in metrics.values():
                metric.update(torch.zeros((), device=self.device))

    def _filler_micro_batch(self) -> MicroBatch:
        """A 2-token pack without labels (this rank's share of it under context parallelism), on this device."""
        filler = collate_pack(Pack(-1, np.zeros(2, dtype=np.int64), np.full(2, IGNORE_INDEX, dtype=np.int64), [2]))
        layout = self.parallelizer.layout
        if layout.cp > 1:
            filler = split_for_context_parallel(filler, layout.context_rank(self.global_rank), layout.cp)
        return filler.to(self.device)

    def _log_eval_metrics(self, stage: str, sets: nn.ModuleDict) -> None:
        for key, metrics in sets.items():
            loss_sum, tokens, correct = (metrics[k].compute() for k in ("loss_sum", "tokens", "correct"))
            loss = loss_sum / tokens.clamp(min=1)
            prefix = stage if key == "0" and len(sets) == 1 else f"{stage}/{self._set_name(stage, int(key))}"
            self.log(f"{prefix}/loss", loss, sync_dist=False, prog_bar=prefix == stage)
            self.log(f"{prefix}/perplexity", torch.exp(loss.clamp(max=50)), sync_dist=False)
            self.log(f"{prefix}/token_accuracy", correct / tokens.clamp(min=1), sync_dist=False)
            for metric in metrics.values():
                metric.reset()

    def _metrics_for(self, sets: nn.ModuleDict, dataloader_idx: int) -> nn.ModuleDict:
        key = str(dataloader_idx)
        if key not in sets:
            sets[key] = nn.ModuleDict(
                {name: torchmetrics.SumMetric().to(self.device) for name in ("loss_sum", "tokens", "correct")}
            )
        return sets[key]

    def _set_name(self, stage: str, dataloader_idx: int) -> str:
        datamodule = self.trainer.datamodule
        names: list[str] = []
        if isinstance(datamodule, XTLDataModule):
            names = datamodule.val_set_names if stage == "val" else datamodule.test_set_names
        return names[dataloader_idx] if dataloader_idx < len(names) else str(dataloader_idx)


class _Decoding(ContextParallelFeature):
    """``xtl predict`` / ``xtl generate``: cached decoding of whole prompts on every rank."""

    def context_parallel_refusal(self, stage: str) -> Refusal | None:
        """Refused in the ``predict`` stage."""
        if stage != "predict":
            return None
        return Refusal("xtl predict / generate decode whole prompts on each process")


_DECODING = _Decoding()


def _drop_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any, keys: set[str]) -> None:
    """State-dict post hook: leave out frozen weights (they are rebuilt from the model source on resume)."""
    for key in keys:
        state_dict.pop(prefix + key, None)


def _reopen_epoch(checkpoint: dict[str, Any]) -> None:
    """Record the current epoch as unfinished in a checkpoint written when ``max_steps`` ended the run.

    Lightning closes the epoch when ``max_steps`` stops a run, although the data epoch goes on (the sampler
    resumes from ``consumed_samples``). A run extended from such a checkpoint (``--ckpt_path last`` with a larger
    ``max_steps``) would otherwise start a new epoch, with its step labels shifted by one. A save made by the
    end-of-run validation also comes after the stepped-batch counter moved on, which the restart counts once more.
    """
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    progress = loop.get("epoch_progress")
    if progress is None or progress["current"]["completed"] < progress["current"]["started"]:
        return
    for scope in ("total", "current"):
        progress[scope]["processed"] -= 1
        progress[scope]["completed"] -= 1
    checkpoint["epoch"] = max(0, checkpoint.get("epoch", 1) - 1)
    validation = loop.get("epoch_loop.val_loop.batch_progress", {})
    if validation.get("is_last_batch") and validation["current"]["completed"] > 0:
        loop["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1  # Lightning's restart adds it again
