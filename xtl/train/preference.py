"""Preference optimization: :class:`PreferenceModule` trains any family on packed pairs with a preference objective.

A preference micro-batch is an ordinary packed :class:`~xtl.data.collate.MicroBatch` whose documents alternate
chosen, rejected, chosen, rejected (pair ``k`` = documents ``2k`` and ``2k + 1``; ``kind: preference`` sources,
``docs/data.md``), labels on the responses only. One forward of the policy gives every response's summed
log-probability (:func:`sequence_logps`); the reference's come from a frozen copy of the starting weights, sharded
like the policy (``reference: live``), or, under LoRA, from the same model with its adapters off (``adapters_off``:
no second copy); SimPO and ORPO need none. The loss (:mod:`xtl.train.preference_loss`) is normalized over the pairs
(and, for its NLL term, the chosen tokens) of the whole step, over micro-batches and data-parallel ranks.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torchmetrics
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from xtl.batch import ModelOutput
from xtl.data.collate import MicroBatch
from xtl.data.item import IGNORE_INDEX
from xtl.errors import ConfigError
from xtl.model import BaseModel
from xtl.module.lora import adapters_disabled, lora_layers
from xtl.strategies.parallelize import WeightSource
from xtl.train.base import LanguageModule
from xtl.train.preference_loss import METRICS, PairTerms, PreferenceLoss, SequenceLogps
from xtl.train.step import forward_backward, global_token_count, grad_norm_and_clip, optimizer_step_unless_nonfinite

ReferenceMode = Literal["auto", "live", "adapters_off", "none"]


def pair_count(batch: MicroBatch) -> int:
    """Pairs in a preference micro-batch: its non-padding documents, halved."""
    return (batch.seq_ctx.num_docs - (1 if batch.seq_ctx.num_padding else 0)) // 2


def sequence_logps(output: ModelOutput, batch: MicroBatch) -> tuple[SequenceLogps, torch.Tensor]:
    """Each response's summed log-probability and token count, and the chosen responses' summed cross-entropy.

    Args:
        output: The model's output with ``token_losses`` (``return_token_losses=True``).
        batch: The preference micro-batch it ran on.

    Returns:
        ``(SequenceLogps, nll_sum)``, with gradient.
    """
    ctx, pairs = batch.seq_ctx, pair_count(batch)
    losses = output.token_losses
    positions = output.token_positions
    if positions is None:
        positions = torch.arange(losses.numel(), device=losses.device)
    targets = batch.labels[0].to(losses.device).index_select(0, positions)
    supervised = targets != IGNORE_INDEX
    ends = ctx.cu_seq_lens[1:].to(losses.device, torch.long)
    document = torch.searchsorted(ends, positions, right=True).clamp(max=2 * pairs)  # padding -> one extra bin
    logps = torch.zeros(2 * pairs + 1, device=losses.device).index_add(0, document, -losses * supervised)
    counts = torch.zeros(2 * pairs + 1, device=losses.device).index_add(0, document, supervised.float())
    logps, counts = logps[: 2 * pairs], counts[: 2 * pairs]
    result = SequenceLogps(logps[0::2], logps[1::2], counts[0::2], counts[1::2])
    return result, -result.chosen.sum()


class PreferenceModule(LanguageModule):
    """Trains an xtl model of any family on preference pairs (DPO, IPO, hinge, robust, SimPO, ORPO).

    Logged on train and validation, with TRL's names: ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (means over pairs) and the
    loss.

    Args:
        model: As :class:`~xtl.train.LanguageModule` (typically the SFT run's HF export).
        objective: The preference loss and its settings.
        reference: Where the reference log-probabilities come from: ``live`` (a frozen copy of the starting weights,
            sharded like the policy), ``adapters_off`` (the trained model with its LoRA adapters off; needs
            ``callbacks/lora.yaml``), ``none`` (SimPO, ORPO) or ``auto`` (``none`` when the loss needs no reference,
            else ``adapters_off`` under LoRA, else ``live``).
        **kwargs: The other arguments of :class:`~xtl.train.LanguageModule`.

    Raises:
        ConfigError: A reference mode the loss or the run cannot use; context parallelism (pairs are summed per
            document on one rank).
    """

    def __init__(
        self,
        model: str | dict[str, Any],
        objective: PreferenceLoss = PreferenceLoss(),
        reference: ReferenceMode = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        self.objective = objective
        self.reference_mode = reference
        if reference == "none" and objective.needs_reference:
            raise ConfigError(
                f"model.init_args.reference: none, but loss_type {objective.loss_type!r} compares with a reference; "
                "use auto, live or adapters_off (or a reference-free loss: simpo, orpo)"
            )
        self._reference: list[BaseModel] = []  # a list: not a submodule (no optimizer state, not in checkpoints)

    # ---- model -----------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build the policy (:meth:`LanguageModule.configure_model`), then the reference the mode asks for."""
        if self.model is not None:
            return
        super().configure_model()
        mode = self.resolved_reference
        if mode == "adapters_off" and not any(True for _ in lora_layers(self.model)):
            raise ConfigError(
                "model.init_args.reference: adapters_off needs LoRA adapters: add --config callbacks/lora.yaml, "
                "or use reference: live"
            )
        if mode == "live":
            with torch.device("meta"):
                reference = self.model_config.build()
            weights = WeightSource(self.hf_dir, self.hparams.seed, getattr(torch, self.hparams.param_dtype))
            reference = self.parallelizer.parallelize(reference, [], weights)
            reference.requires_grad_(False)
            self._reference = [reference.eval()]

    def on_fit_start(self) -> None:
        """Say which objective and reference train."""
        objective, mode = self.objective, self.resolved_reference
        what = {"live": "a frozen copy of the starting weights, sharded like the policy",
                "adapters_off": "the model with its LoRA adapters off", "none": "none needed"}[mode]  # fmt: skip
        rank_zero_info(
            f"xtl preference: loss {objective.loss_type} (beta {objective.beta}), reference: {mode} ({what})"
        )

    @property
    def resolved_reference(self) -> str:
        """The reference mode in effect (``auto`` resolved; adapters are seen once the model is built)."""
        if self.reference_mode != "auto":
            return self.reference_mode
        if not self.objective.needs_reference:
            return "none"
        lora = self.model is not None and any(True for _ in lora_layers(self.model))
        return "adapters_off" if lora else "live"

    def setup(self, stage: str) -> None:
        """Refuse context parallelism (a response's log-probability is summed on one rank)."""
        super().setup(stage)
        if self.parallelizer.layout.cp > 1:
            raise ConfigError(
                "preference optimization sums each response's log-probability on one rank: set "
                "trainer.strategy.init_args.context_parallel_size to 1"
            )

    # ---- training --------------------------------------------------------------------------------------------

    def training_step(self, batch: list[Any], batch_idx: int) -> torch.Tensor:
        """One optimizer step over this rank's preference micro-batches.

        Each micro-batch adds ``sum of pair losses / P + nll_weight * chosen NLL sum / N`` (``P`` pairs and ``N``
        chosen response tokens of the whole step, all data-parallel ranks) to the loss, so the gradient does not
        depend on how pairs are split into micro-batches and ranks.
        """
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        for behaviour in self.family_training:
            behaviour.start_step(len(batch), self.device)
        group = self.parallelizer.data_group()
        chosen_tokens = global_token_count(sum(_chosen_tokens(mb) for mb in batch), self.device, group)
        pairs = global_token_count(sum(pair_count(mb) for mb in batch), self.device, group)
        ratio = pairs.clamp(min=1) / chosen_tokens.clamp(min=1)  # the NLL term's mean, in units of pairs
        sums: list[dict[str, torch.Tensor]] = []

        def forward(mb: MicroBatch) -> ModelOutput:
            output, terms = self._pair_terms(mb)
            sums.append(terms.metric_sums)
            loss_sum = terms.loss_sum + self.objective.nll_weight * terms.nll_sum * ratio
            return ModelOutput(loss_sum=loss_sum, num_tokens=None, extras=output.extras)

        result = forward_backward(
            forward=forward,
            micro_batches=batch,
            num_tokens=pair_count,
            dp_world_size=self._averaged_ranks(),
            backward=self.manual_backward,
            device=self.device,
            group=group,
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
        metrics = self._sum_over_data_ranks(torch.stack([sum(s[k] for s in sums) for k in METRICS]))
        metrics = metrics / result.global_tokens.clamp(min=1)
        values = {f"train/{k}": v for k, v in zip(METRICS, metrics)}
        values.update({f"train/{k}": v for b in self.family_training for k, v in b.step_metrics().items()})
        self.log_dict(values, on_step=True, on_epoch=False, batch_size=1)
        return result.loss_sum / result.global_tokens.clamp(min=1)

    # ---- validation ------------------------------------------------------------------------------------------

    def validation_step(self, batch: list[Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Accumulate the pairs' loss and metric sums of one held-out set (torchmetrics, synced across ranks)."""
        metrics = self._preference_metrics(self._val_metrics, dataloader_idx)
        with torch.no_grad():
            for mb in batch:
                if pair_count(mb) == 0:
                    continue
                _, terms = self._pair_terms(mb)
                chosen = _chosen_tokens(mb)
                loss = terms.loss_sum + self.objective.nll_weight * terms.nll_sum * pair_count(mb) / max(chosen, 1)
                metrics["loss"].update(loss.detach())
                metrics["pairs"].update(torch.tensor(float(pair_count(mb)), device=self.device))
                for key in METRICS:
                    metrics[key].update(terms.metric_sums[key])
        for metric in metrics.values():  # a rank without pairs still joins the sync
            metric.update(torch.zeros((), device=self.device))

    def on_validation_epoch_end(self) -> None:
        """Log ``val/loss`` and ``val/rewards/...``, ``val/logps/...`` (``val/<set>/...`` for several sets)."""
        for key, metrics in self._val_metrics.items():
            values = {name: metric.compute() for name, metric in metrics.items()}
            pairs = values.pop("pairs").clamp(min=1)
            name = self._set_name("val", int(key))
            prefix = "val" if key == "0" and len(self._val_metrics) == 1 else f"val/{name}"
            for metric_name, total in values.items():
                self.log(f"{prefix}/{metric_name}", total / pairs, sync_dist=False, prog_bar=metric_name == "loss")
            for metric in metrics.values():
                metric.reset()

    # ---- private ---------------------------------------------------------------------------------------------

    def _pair_terms(self, mb: MicroBatch) -> tuple[ModelOutput, PairTerms]:
        """The policy's output and the pair terms of one micro-batch (the reference's log-probabilities without
        gradient)."""
        output = self.model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False, return_token_losses=True)
        policy, nll_sum = sequence_logps(output, mb)
        reference = None
        mode = self.resolved_reference
        if mode != "none":
            with torch.no_grad():
                if mode == "live":
                    ref_model = self._reference[0]
                    ref_out = ref_model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False,
                                        return_token_losses=True)  # fmt: skip
                else:
                    with adapters_disabled(self.model):
                        ref_out = self.model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False,
                                             return_token_losses=True)  # fmt: skip
                reference, _ = sequence_logps(ref_out, mb)
        return output, self.objective.terms(policy, reference, nll_sum)

    def _preference_metrics(self, sets: nn.ModuleDict, dataloader_idx: int) -> nn.ModuleDict:
        key = str(dataloader_idx)
        if key not in sets:
            names = ("loss", "pairs", *METRICS)
            sets[key] = nn.ModuleDict({n: torchmetrics.SumMetric().to(self.device) for n in names})
        return sets[key]


def _chosen_tokens(batch: MicroBatch) -> int:
    """Supervised tokens of the chosen responses of a preference micro-batch (host-side)."""
    bounds = batch.seq_ctx.doc_bounds
    labels = batch.labels[0]
    pairs = pair_count(batch)
    return sum(int((labels[bounds[2 * k] : bounds[2 * k + 1]] != IGNORE_INDEX).sum()) for k in range(pairs))
