"""Preference optimization: :class:`PreferenceModule` trains any family on packed pairs with a preference objective.

A preference micro-batch is an ordinary packed :class:`~xtl.data.collate.MicroBatch` whose documents alternate
chosen, rejected, chosen, rejected (pair ``k`` = documents ``2k`` and ``2k + 1``; ``kind: preference`` sources,
``docs/data.md``), labels on the responses only. One forward of the policy gives every response's summed
log-probability (:func:`~xtl.train.scorer.score_tokens`, :func:`sequence_logps`); the reference's come from the
objective's :class:`~xtl.train.reference.ReferencePolicy` (the starting policy, frozen: a copy, or under LoRA the
policy with its starting adapters; a separate model; or a table computed once before training and cached with the
data, :mod:`xtl.train.reference_tables`); SimPO and ORPO need none. The loss (:mod:`xtl.train.preference_loss`) is
normalized over the pairs (and, for its NLL term, the chosen tokens) of the whole step, over micro-batches and
data-parallel ranks.

KTO trains on unpaired data (``kind: unpaired_preference``, :mod:`xtl.data.unpaired`): each "pair" is a row's own
completion and a mismatched completion, the documents carry the rows' labels (``MicroBatch.doc_tags``), and the
mismatched completions' log-probabilities give the KL reference point of each micro-batch. TRL estimates it per batch
and averages it over processes; xtl keeps the estimate of each micro-batch (a pack of many rows), so that a run's
losses do not depend on how its packs are spread over data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torchmetrics
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from xtl.batch import ModelOutput, SequenceContext
from xtl.data.collate import MicroBatch, loss_rows
from xtl.data.datamodule import XTLDataModule
from xtl.data.item import IGNORE_INDEX
from xtl.data.preference import PREFERENCE_KIND
from xtl.data.unpaired import UNPAIRED_KIND
from xtl.errors import ConfigError
from xtl.train.base import LanguageModule
from xtl.train.preference_loss import UNPAIRED, PairTerms, PreferenceLoss, SequenceLogps
from xtl.train.reference import ReferenceConfig, ReferenceMode, ReferencePolicy, reference_config
from xtl.train.reference_tables import TRAIN_SET, PrecomputedReference
from xtl.train.scorer import TokenScores, context_sum, document_sums, score_tokens
from xtl.train.step import global_token_count


def pair_count(batch: MicroBatch) -> int:
    """Pairs in a preference micro-batch: its non-padding documents, halved."""
    return (batch.seq_ctx.num_docs - (1 if batch.seq_ctx.num_padding else 0)) // 2


def sequence_logps(
    scores: TokenScores, batch: MicroBatch, group: dist.ProcessGroup | None = None
) -> tuple[SequenceLogps, torch.Tensor]:
    """Each response's summed log-probability and token count, and the chosen responses' summed cross-entropy.

    Args:
        scores: The model's scores of the micro-batch (:func:`~xtl.train.scorer.score_tokens`).
        batch: The preference micro-batch they were computed on (a context-parallel share: its positions are those
            of the whole pack from ``seq_ctx.share_start`` on).
        group: The context-parallel group whose shares hold the rest of the pack (``None``: the whole pack is here).
            The per-response sums are summed over it (differentiably, :func:`~xtl.train.scorer.document_sums`); the
            cross-entropy sum stays this share's.

    Returns:
        ``(SequenceLogps, nll_sum)``, with gradient.
    """
    docs = 2 * pair_count(batch)
    share = document_sums(scores.logps, scores.positions, batch.seq_ctx, docs)
    nll_sum = -share[0::2].sum()
    logps = context_sum(share, group)
    counts = document_sums(scores.scored.float(), scores.positions, batch.seq_ctx, docs, group)
    return SequenceLogps(logps[0::2], logps[1::2], counts[0::2], counts[1::2]), nll_sum


class PairMetrics:
    """Held-out metrics of a pairwise objective (preference optimization, reward modelling), for a
    :class:`~xtl.train.LanguageModule` subclass whose ``objective`` has ``metric_means(sums, pairs)``: per held-out
    set, torchmetrics sums of the loss, the pairs and each metric (synced across ranks), logged as means over pairs.
    """

    def pair_metrics(self, dataloader_idx: int, names: Iterable[str]) -> nn.ModuleDict:
        """The sums of one held-out set (``loss``, ``pairs`` and ``names``), made at its first batch."""
        key, sets = str(dataloader_idx), self._val_metrics
        if key not in sets:
            sets[key] = nn.ModuleDict({n: torchmetrics.SumMetric().to(self.device) for n in ("loss", "pairs", *names)})
        return sets[key]

    def join_metric_sync(self, metrics: nn.ModuleDict) -> None:
        """Add zero to every sum: a rank without pairs still joins the sync."""
        for metric in metrics.values():
            metric.update(torch.zeros((), device=self.device))

    def log_pair_metrics(self) -> None:
        """Log ``val/loss`` and the objective's metrics as means over the pairs (``val/<set>/...`` for several
        sets), then reset the sums."""
        for key, metrics in self._val_metrics.items():
            values = {name: metric.compute() for name, metric in metrics.items()}
            pairs = values.pop("pairs").clamp(min=1)
            name = self._set_name("val", int(key))
            prefix = "val" if key == "0" and len(self._val_metrics) == 1 else f"val/{name}"
            means = {"loss": values["loss"] / pairs, **self.objective.metric_means(values, pairs)}
            for metric_name, value in means.items():
                self.log(f"{prefix}/{metric_name}", value, sync_dist=False, prog_bar=metric_name == "loss")
            for metric in metrics.values():
                metric.reset()


@dataclass
class UnpairedMicroBatch(MicroBatch):
    """An unpaired (KTO) training micro-batch with its rows' own documents and their mismatched (KL) documents also
    packed apart, cut on the host (:func:`split_unpaired`): the rows train with gradient, the mismatched documents
    only give the KL estimate, so they run forward without gradient (no backward through them).

    Attributes:
        rows: The even documents (each row's own completion), packed.
        mismatched: The odd documents (the mismatched completions), packed.
    """

    rows: MicroBatch | None = None
    mismatched: MicroBatch | None = None

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> UnpairedMicroBatch:
        """The micro-batch and both parts on ``device``."""
        whole = MicroBatch.to(self, device, non_blocking)
        parts = {name: getattr(self, name).to(device, non_blocking) for name in ("rows", "mismatched")}
        return UnpairedMicroBatch(**{f: getattr(whole, f) for f in MicroBatch.__dataclass_fields__}, **parts)


def documents_apart(batch: MicroBatch, first: int, docs: int) -> MicroBatch:
    """Documents ``first, first + 2, ...`` (below ``docs``) of a host-side micro-batch, packed as a micro-batch of
    their own (labels, per-document positions and the head's rows as :func:`~xtl.data.collate.collate_pack` makes
    them)."""
    bounds = batch.seq_ctx.doc_bounds
    spans = [(bounds[k], bounds[k + 1]) for k in range(first, docs, 2)]
    ids = torch.cat([batch.seq_ctx.input_ids[:, a:b] for a, b in spans], dim=1)
    labels = torch.cat([batch.labels[:, a:b] for a, b in spans], dim=1)
    ctx = SequenceContext.from_lengths(ids, [b - a for a, b in spans])
    supervised = np.flatnonzero(labels[0].numpy() != IGNORE_INDEX)
    rows = loss_rows(supervised, labels.shape[1])
    if rows is not None:
        ctx.loss_positions = torch.from_numpy(rows)
    tags = None if batch.doc_tags is None else tuple(batch.doc_tags[first:docs:2])
    return MicroBatch(ctx, labels, int(supervised.size), ids.shape[1], batch.pack_index, tags)


def split_unpaired(batch: MicroBatch) -> MicroBatch:
    """An unpaired host-side micro-batch with its rows and mismatched documents packed apart
    (:class:`UnpairedMicroBatch`); unchanged when it cannot be cut (a context-parallel share, images, no pairs)."""
    ctx = batch.seq_ctx
    docs = 2 * pair_count(batch)
    if docs == 0 or ctx.doc_bounds is None or ctx.extras or ctx.share_start or ctx.input_ids is None:
        return batch
    if ctx.input_ids.device.type != "cpu" or ctx.pack_input_ids is not None:
        return batch
    fields = {f: getattr(batch, f) for f in MicroBatch.__dataclass_fields__}
    return UnpairedMicroBatch(
        **fields, rows=documents_apart(batch, 0, docs), mismatched=documents_apart(batch, 1, docs)
    )


class PreferenceModule(PairMetrics, LanguageModule):
    """Trains an xtl model of any family on preference pairs (DPO, IPO, hinge, robust, SimPO, ORPO) or on unpaired
    labeled completions (KTO, unpaired APO-zero).

    Logged on train and validation, with TRL's names: ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (means over pairs) and the
    loss; for KTO, ``rewards/...`` and ``logps/...`` over the desirable (``chosen``) and undesirable (``rejected``)
    rows, ``rewards/margins`` and ``kl`` (no ``rewards/accuracies``).

    Args:
        model: As :class:`~xtl.train.LanguageModule` (typically the SFT run's HF export).
        objective: The preference loss and its settings.
        reference: Where the reference log-probabilities come from (:class:`~xtl.train.reference.ReferenceConfig`, or
            a mode name): ``auto`` (``none`` when the loss needs no reference, ``adapters_off`` under fresh LoRA
            adapters, else ``live``), ``live`` (the starting policy, frozen: a copy sharded like the policy, or under
            LoRA the policy with its starting adapters), ``adapters_off`` (the model with its fresh LoRA adapters
            off), ``precomputed`` (a table of every pair's, computed once before the first step from the starting
            policy and cached with the data: no reference forward while training), ``model`` (a separate model) or
            ``none`` (SimPO, ORPO); with ``sync_every``, TR-DPO's periodic sync.
        **kwargs: The other arguments of :class:`~xtl.train.LanguageModule`.

    Raises:
        ConfigError: A reference mode the loss or the run cannot use; ``precomputed`` without an
            :class:`~xtl.data.XTLDataModule`; data of the other kind (pairs for KTO, unpaired rows for a paired loss).
    """

    objective = "preference (DPO, KTO, ...)"
    trains_mtp = False  # multi-token prediction belongs to next-token training

    def __init__(
        self,
        model: str | dict[str, Any],
        objective: PreferenceLoss = PreferenceLoss(),
        reference: ReferenceMode | ReferenceConfig = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        self.objective = objective
        self.reference = ReferencePolicy(reference_config(reference), objective.needs_reference)
        self.precomputed = PrecomputedReference(self, _pair_logps, code=(sequence_logps, score_tokens))

    # ---- model -----------------------------------------------------------------------------------------------

    def on_fit_start(self) -> None:
        """Say which objective and reference train."""
        objective, reference = self.objective, self.reference
        rank_zero_info(
            f"xtl preference: loss {objective.loss_type} (beta {objective.beta}), reference: {reference.mode} "
            f"({reference.describe()})"
        )

    def on_train_start(self) -> None:
        """``reference: precomputed``: have the reference table of the training set and of each validation set
        before the first step (:meth:`PrecomputedReference.prepare`), then start the throughput window."""
        if self.reference.mode == "precomputed":
            self.precomputed.prepare()
        super().on_train_start()

    def on_validation_start(self) -> None:
        """``reference: precomputed``: the tables, if no training step came first (the sanity check, ``validate``)."""
        if self.reference.mode == "precomputed":
            self.precomputed.prepare()

    def setup(self, stage: str) -> None:
        """Refuse data of the kind the objective does not train on."""
        super().setup(stage)
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        if isinstance(datamodule, XTLDataModule):
            self._check_data_kinds(datamodule)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """KTO and unpaired APO-zero training batches: each micro-batch's rows and mismatched documents are also
        packed apart (:func:`split_unpaired`), so that only the rows run backward. Context parallelism keeps its
        own split (the joint forward)."""
        batch = super().on_before_batch_transfer(batch, dataloader_idx)
        trainer = self._trainer
        if (
            not self.objective.unpaired
            or trainer is None
            or not trainer.training
            or self.parallelizer.layout.cp > 1
            or not isinstance(batch, list)
        ):
            return batch
        return [split_unpaired(mb) if isinstance(mb, MicroBatch) and mb.doc_tags is not None else mb for mb in batch]

    # ---- training --------------------------------------------------------------------------------------------

    def training_step(self, batch: list[Any], batch_idx: int) -> torch.Tensor:
        """One optimizer step over this rank's preference micro-batches (:meth:`step_objective`)."""
        forward, sums = self.step_objective(batch)
        result = self.optimizer_step_over(batch, forward, pair_count)
        keys = self.objective.metric_sums
        totals = self._sum_over_data_ranks(torch.stack([sum(s[k] for s in sums) for k in keys]))
        means = self.objective.metric_means(dict(zip(keys, totals)), result.global_tokens)
        self.log_step_metrics({f"train/{k}": v for k, v in means.items()})
        return result.loss_sum / result.global_tokens.clamp(min=1)

    def step_objective(
        self, batch: list[MicroBatch]
    ) -> tuple[Callable[[MicroBatch], ModelOutput], list[dict[str, torch.Tensor]]]:
        """The objective of one step: a micro-batch's forward, whose ``loss_sum`` the step divides by the step's
        pairs (:func:`pair_count`, over micro-batches and data-parallel ranks), and the list its metric sums are
        appended to.

        Each micro-batch adds ``sum of pair losses / P + nll_weight * chosen NLL sum / N`` (``P`` pairs and ``N``
        chosen response tokens of the whole step, all data-parallel ranks) to the loss, so the gradient does not
        depend on how pairs are split into micro-batches and ranks. Under context parallelism every rank of a group
        holds the whole pack's pair terms (and counts its pairs), and its share's NLL tokens.
        """
        group = self.parallelizer.data_group()
        chosen_tokens = global_token_count(sum(_chosen_tokens(mb) for mb in batch), self.device, group)
        pairs = global_token_count(sum(pair_count(mb) for mb in batch), self.device, group)
        ratio = pairs.clamp(min=1) / chosen_tokens.clamp(min=1)  # the NLL term's mean, in units of pairs
        sums: list[dict[str, torch.Tensor]] = []

        def forward(mb: MicroBatch) -> ModelOutput:
            output, terms, _ = self._pair_terms(mb)
            sums.append(terms.metric_sums)
            loss_sum = terms.loss_sum + self.objective.nll_weight * terms.nll_sum * ratio
            return ModelOutput(loss_sum=loss_sum, num_tokens=None, extras=output.extras)

        return forward, sums

    # ---- validation ------------------------------------------------------------------------------------------

    def validation_step(self, batch: list[Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Accumulate the pairs' loss and metric sums of one held-out set (torchmetrics, synced across ranks)."""
        metrics = self.pair_metrics(dataloader_idx, self.objective.metric_sums)
        with torch.no_grad():
            for mb, real in self.eval_micro_batches(batch):
                if not real or pair_count(mb) == 0:  # every rank runs as many forwards (sharded parameters)
                    self._filler_forwards(mb)
                    continue
                _, terms, policy = self._pair_terms(mb, f"val/{dataloader_idx}")
                nll = -policy.chosen.sum() / policy.chosen_tokens.sum().clamp(
                    min=1
                )  # the whole pack's, on every share
                loss = terms.loss_sum + self.objective.nll_weight * nll * pair_count(mb)
                metrics["loss"].update(loss.detach())
                metrics["pairs"].update(torch.tensor(float(pair_count(mb)), device=self.device))
                for key in self.objective.metric_sums:
                    metrics[key].update(terms.metric_sums[key])
        self.join_metric_sync(metrics)

    def on_validation_epoch_end(self) -> None:
        """Log ``val/loss`` and ``val/rewards/...``, ``val/logps/...`` (``val/<set>/...`` for several sets)."""
        self.log_pair_metrics()

    # ---- private ---------------------------------------------------------------------------------------------

    def _filler_forwards(self, mb: MicroBatch) -> None:
        """The forwards of a micro-batch without pairs: the policy, and the reference when it computes."""
        self.model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False)
        if self.reference.computes_live:
            with self.reference.computing(self.model) as reference:
                reference(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False)

    def _pair_terms(self, mb: MicroBatch, dataset: str = TRAIN_SET) -> tuple[ModelOutput, PairTerms, SequenceLogps]:
        """The policy's output, the pair terms of one micro-batch and the policy's log-probabilities (the
        reference's without gradient; under ``precomputed``, those of ``mb.pack_index`` in the table of ``dataset``:
        ``train`` or ``val/<dataloader_idx>``). Under context parallelism the log-probabilities are the whole
        pack's, summed over the shares. KTO's KL reference point is this micro-batch's estimate."""
        unpaired = self.objective.unpaired
        if unpaired != (mb.doc_tags is not None):
            raise ConfigError(_kind_mismatch(self.objective.loss_type, "this micro-batch's"))
        group = self.parallelizer.meshes.cp_group()
        if isinstance(mb, UnpairedMicroBatch) and torch.is_grad_enabled():
            scores, policy, nll_sum = self._unpaired_policy(mb)
        else:
            scores = score_tokens(self.model, mb.seq_ctx, mb.labels)
            policy, nll_sum = sequence_logps(scores, mb, group)
        reference = None
        if self.reference.mode == "precomputed":
            chosen, rejected = self.precomputed.lookup(dataset, mb.pack_index, pair_count(mb))
            reference = SequenceLogps(chosen, rejected, policy.chosen_tokens, policy.rejected_tokens)
        elif self.reference.computes_live:
            with self.reference.computing(self.model) as model:
                reference, _ = sequence_logps(score_tokens(model, mb.seq_ctx, mb.labels), mb, group)
        output = ModelOutput(extras=scores.extras)
        if not unpaired:
            return output, self.objective.terms(policy, reference, nll_sum), policy
        labels = torch.tensor(mb.doc_tags[0 : 2 * pair_count(mb) : 2], dtype=torch.bool, device=self.device)
        kl = self.objective.kl_point(policy, reference) if self.objective.loss_type == "kto" else None
        return output, self.objective.terms(policy, reference, nll_sum, labels, kl), policy

    def _unpaired_policy(self, mb: UnpairedMicroBatch) -> tuple[TokenScores, SequenceLogps, torch.Tensor]:
        """The policy's scores of the rows (with gradient) and its log-probabilities of the rows and of the
        mismatched documents (without gradient; KTO's KL estimate, none for unpaired APO-zero: zeros)."""
        pairs = pair_count(mb)
        rows, mismatched = mb.rows, mb.mismatched
        scores = score_tokens(self.model, rows.seq_ctx, rows.labels)
        chosen = document_sums(scores.logps, scores.positions, rows.seq_ctx, pairs)
        chosen_tokens = document_sums(scores.scored.float(), scores.positions, rows.seq_ctx, pairs)
        if self.objective.loss_type == "kto":
            with torch.no_grad():
                other = score_tokens(self.model, mismatched.seq_ctx, mismatched.labels)
                rejected = document_sums(other.logps, other.positions, mismatched.seq_ctx, pairs)
                rejected_tokens = document_sums(other.scored.float(), other.positions, mismatched.seq_ctx, pairs)
        else:
            rejected, rejected_tokens = torch.zeros_like(chosen), torch.zeros_like(chosen_tokens)
        return scores, SequenceLogps(chosen, rejected, chosen_tokens, rejected_tokens), -chosen.sum()

    def _check_data_kinds(self, datamodule: XTLDataModule) -> None:
        """Refuse sets of the kind the objective does not train on (a chat set, pairs for KTO, rows for DPO)."""
        want = UNPAIRED_KIND if self.objective.unpaired else PREFERENCE_KIND
        sets = [("data.sources", datamodule.sources)]
        sets += [(f"data.val_sources.{name}", specs) for name, specs in datamodule.val_sources.items()]
        for key, specs in sets:
            other = sorted({spec.kind for spec in specs} - {want})
            if other:
                raise ConfigError(_kind_mismatch(self.objective.loss_type, f"{key} has kind: {other[0]};"))
            for i, spec in enumerate(specs):
                if spec.margin_key is not None:
                    raise ConfigError(
                        f"{key}[{i}].margin_key: pair margins are read by reward modelling (xtl.train.RewardModule); "
                        f"{self.objective.loss_type} has no margin: remove it"
                    )


def _pair_logps(
    model: nn.Module, mb: MicroBatch, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and rejected summed log-probabilities of a micro-batch's pairs (a precomputed table's rows)."""
    logps, _ = sequence_logps(score_tokens(model, mb.seq_ctx, mb.labels), mb, group)
    return logps.chosen, logps.rejected


def _kind_mismatch(loss_type: str, found: str) -> str:
    """The message for data of the wrong kind for ``loss_type``."""
    if loss_type in UNPAIRED:
        return (
            f"model.init_args.objective.loss_type: {loss_type} trains on rows labeled desirable or not "
            f"(kind: {UNPAIRED_KIND}); {found} data: set kind: {UNPAIRED_KIND} on the sources (preference pairs are "
            "unpaired: chosen desirable, rejected not)"
        )
    return (
        f"model.init_args.objective.loss_type: {loss_type} trains on chosen/rejected pairs (kind: {PREFERENCE_KIND}); "
        f"{found} data: set kind: {PREFERENCE_KIND} on the sources, or use loss_type: kto for labeled rows"
    )


def _chosen_tokens(batch: MicroBatch) -> int:
    """Supervised tokens of the chosen responses in a preference micro-batch (host-side; a context-parallel share
    counts its own)."""
    start, labels = batch.seq_ctx.share_start, batch.labels[0]
    bounds = [min(max(b - start, 0), labels.numel()) for b in batch.seq_ctx.doc_bounds]
    pairs = pair_count(batch)
    return sum(int((labels[bounds[2 * k] : bounds[2 * k + 1]] != IGNORE_INDEX).sum()) for k in range(pairs))
