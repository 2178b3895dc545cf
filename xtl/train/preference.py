"""Preference optimization: :class:`PreferenceModule` trains any family on packed pairs with a preference objective.

A preference micro-batch is an ordinary packed :class:`~xtl.data.collate.MicroBatch` whose documents alternate
chosen, rejected, chosen, rejected (pair ``k`` = documents ``2k`` and ``2k + 1``; ``kind: preference`` sources,
``docs/data.md``), labels on the responses only. One forward of the policy gives every response's summed
log-probability (:func:`sequence_logps`); the reference's come from a frozen copy of the starting weights, sharded
like the policy (``reference: live``), or, under LoRA, from the same model with its adapters off (``adapters_off``:
no second copy), or from a table computed once before training and cached with the data (``precomputed``,
:mod:`xtl.train.reference_cache`); SimPO and ORPO need none. The loss (:mod:`xtl.train.preference_loss`) is
normalized over the pairs (and, for its NLL term, the chosen tokens) of the whole step, over micro-batches and
data-parallel ranks.

KTO trains on unpaired data (``kind: unpaired_preference``, :mod:`xtl.data.unpaired`): each "pair" is a row's own
completion and a mismatched completion, the documents carry the rows' labels (``MicroBatch.doc_tags``), and the
mismatched completions' log-probabilities give the KL reference point of each micro-batch. TRL estimates it per batch
and averages it over processes; xtl keeps the estimate of each micro-batch (a pack of many rows), so that a run's
losses do not depend on how its packs are spread over data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torchmetrics
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from xtl.batch import ModelOutput
from xtl.data.collate import MicroBatch
from xtl.data.datamodule import PackedSplit, XTLDataModule
from xtl.data.item import IGNORE_INDEX
from xtl.data.preference import PREFERENCE_KIND
from xtl.data.sources import FileHashMemo
from xtl.data.unpaired import UNPAIRED_KIND
from xtl.errors import ConfigError
from xtl.model import BaseModel
from xtl.module.lora import adapters_disabled, lora_layers
from xtl.strategies.parallelize import TransformStage
from xtl.train.base import LanguageModule
from xtl.train.preference_loss import UNPAIRED, PairTerms, PreferenceLoss, SequenceLogps
from xtl.train.reference_cache import (
    ReferenceForward,
    ReferenceTable,
    compute_reference_table,
    load_reference_table,
    pair_offsets,
    reference_key,
    reference_table_path,
    save_reference_table,
    weights_fingerprint,
)
from xtl.train.step import global_token_count

ReferenceMode = Literal["auto", "live", "adapters_off", "precomputed", "none"]
TRAIN_SET = "train"


def pair_count(batch: MicroBatch) -> int:
    """Pairs in a preference micro-batch: its non-padding documents, halved."""
    return (batch.seq_ctx.num_docs - (1 if batch.seq_ctx.num_padding else 0)) // 2


def sequence_logps(
    output: ModelOutput, batch: MicroBatch, group: dist.ProcessGroup | None = None
) -> tuple[SequenceLogps, torch.Tensor]:
    """Each response's summed log-probability and token count, and the chosen responses' summed cross-entropy.

    Args:
        output: The model's output with ``token_losses`` (``return_token_losses=True``).
        batch: The preference micro-batch it ran on (a context-parallel share: its positions are those of the whole
            pack from ``seq_ctx.share_start`` on).
        group: The context-parallel group whose shares hold the rest of the pack (``None``: the whole pack is here).
            The per-response sums are all-reduced over it (differentiably, so each share's tokens get their
            gradient); the cross-entropy sum stays this share's.

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
    document = torch.searchsorted(ends, positions + ctx.share_start, right=True).clamp(max=2 * pairs)  # padding: 1 bin
    logps = torch.zeros(2 * pairs + 1, dtype=losses.dtype, device=losses.device)
    logps = logps.index_add(0, document, -losses * supervised)
    counts = torch.zeros(2 * pairs + 1, device=losses.device).index_add(0, document, supervised.float())
    logps, counts = logps[: 2 * pairs], counts[: 2 * pairs]
    nll_sum = -logps[0::2].sum()
    if group is not None:
        logps = _AllReduceSum.apply(logps, group)
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
    return SequenceLogps(logps[0::2], logps[1::2], counts[0::2], counts[1::2]), nll_sum


class PreferenceModule(LanguageModule):
    """Trains an xtl model of any family on preference pairs (DPO, IPO, hinge, robust, SimPO, ORPO) or on unpaired
    labeled completions (KTO, unpaired APO-zero).

    Logged on train and validation, with TRL's names: ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (means over pairs) and the
    loss; for KTO, ``rewards/...`` and ``logps/...`` over the desirable (``chosen``) and undesirable (``rejected``)
    rows, ``rewards/margins`` and ``kl`` (no ``rewards/accuracies``).

    Args:
        model: As :class:`~xtl.train.LanguageModule` (typically the SFT run's HF export).
        objective: The preference loss and its settings.
        reference: Where the reference log-probabilities come from: ``live`` (a frozen copy of the starting weights,
            sharded like the policy), ``adapters_off`` (the trained model with its LoRA adapters off; needs
            ``callbacks/lora.yaml``), ``precomputed`` (a table of every pair's, computed once before the first step
            from the starting weights and cached with the data: no reference forward while training; see
            :meth:`on_train_start`), ``none`` (SimPO, ORPO) or ``auto`` (``none`` when the loss needs no reference,
            else ``adapters_off`` under LoRA, else ``live``).
        **kwargs: The other arguments of :class:`~xtl.train.LanguageModule`.

    Raises:
        ConfigError: A reference mode the loss or the run cannot use; ``precomputed`` with context parallelism or
            without an :class:`~xtl.data.XTLDataModule`; data of the other kind (pairs for KTO, unpaired rows for
            a paired loss).
    """

    trains_mtp = False  # multi-token prediction belongs to next-token training

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
                "use auto, live, adapters_off or precomputed (or a reference-free loss: simpo, orpo)"
            )
        if reference == "precomputed" and not objective.needs_reference:
            raise ConfigError(
                f"model.init_args.reference: precomputed, but loss_type {objective.loss_type!r} uses no reference; "
                "use reference: auto or none"
            )
        self._reference: list[BaseModel] = []  # a list: not a submodule (no optimizer state, not in checkpoints)
        self._tables: dict[str, ReferenceTable] = {}  # precomputed: set ("train", "val/<idx>") -> table, on device

    # ---- model -----------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build the policy (:meth:`LanguageModule.configure_model`), then the reference the mode asks for."""
        if self.model is not None:
            return
        super().configure_model()
        self._reference = self.build_reference(self.resolved_reference)

    def on_fit_start(self) -> None:
        """Say which objective and reference train."""
        objective, mode = self.objective, self.resolved_reference
        what = {"live": "a frozen copy of the starting weights, sharded like the policy",
                "adapters_off": "the model with its LoRA adapters off",
                "precomputed": "the starting weights' log-probabilities, computed once and cached with the data",
                "none": "none needed"}[mode]  # fmt: skip
        rank_zero_info(
            f"xtl preference: loss {objective.loss_type} (beta {objective.beta}), reference: {mode} ({what})"
        )

    def on_train_start(self) -> None:
        """``reference: precomputed``: have the reference table of the training set and of each validation set
        before the first step (:meth:`_prepare_reference_tables`), then start the throughput window."""
        self._prepare_reference_tables()
        super().on_train_start()

    def on_validation_start(self) -> None:
        """``reference: precomputed``: the tables, if no training step came first (the sanity check, ``validate``)."""
        self._prepare_reference_tables()

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
        """Refuse precomputed references under context parallelism (the one pass forwards whole packs per rank), and
        data of the kind the objective does not train on."""
        super().setup(stage)
        if self.parallelizer.layout.cp > 1 and self.reference_mode == "precomputed":
            raise ConfigError(
                "model.init_args.reference: precomputed computes whole packs on each data-parallel rank; with "
                "trainer.strategy.init_args.context_parallel_size > 1 use reference: live (or adapters_off)"
            )
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        if isinstance(datamodule, XTLDataModule):
            self._check_data_kinds(datamodule)

    # ---- training --------------------------------------------------------------------------------------------

    def training_step(self, batch: list[Any], batch_idx: int) -> torch.Tensor:
        """One optimizer step over this rank's preference micro-batches.

        Each micro-batch adds ``sum of pair losses / P + nll_weight * chosen NLL sum / N`` (``P`` pairs and ``N``
        chosen response tokens of the whole step, all data-parallel ranks) to the loss, so the gradient does not
        depend on how pairs are split into micro-batches and ranks.
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

        result = self.optimizer_step_over(batch, forward, pair_count)
        keys = self.objective.metric_sums
        totals = self._sum_over_data_ranks(torch.stack([sum(s[k] for s in sums) for k in keys]))
        means = self.objective.metric_means(dict(zip(keys, totals)), result.global_tokens)
        self.log_step_metrics({f"train/{k}": v for k, v in means.items()})
        return result.loss_sum / result.global_tokens.clamp(min=1)

    # ---- validation ------------------------------------------------------------------------------------------

    def validation_step(self, batch: list[Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Accumulate the pairs' loss and metric sums of one held-out set (torchmetrics, synced across ranks)."""
        metrics = self._preference_metrics(self._val_metrics, dataloader_idx)
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
        for metric in metrics.values():  # a rank without pairs still joins the sync
            metric.update(torch.zeros((), device=self.device))

    def on_validation_epoch_end(self) -> None:
        """Log ``val/loss`` and ``val/rewards/...``, ``val/logps/...`` (``val/<set>/...`` for several sets)."""
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

    # ---- private ---------------------------------------------------------------------------------------------

    def _filler_forwards(self, mb: MicroBatch) -> None:
        """The forwards of a micro-batch without pairs: the policy, and the live reference when there is one."""
        self.model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False)
        if self.resolved_reference == "live":
            self._reference[0](seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False)

    def _pair_terms(self, mb: MicroBatch, dataset: str = TRAIN_SET) -> tuple[ModelOutput, PairTerms, SequenceLogps]:
        """The policy's output, the pair terms of one micro-batch and the policy's log-probabilities (the
        reference's without gradient; under ``precomputed``, those of ``mb.pack_index`` in the table of ``dataset``:
        ``train`` or ``val/<dataloader_idx>``). Under context parallelism the log-probabilities are the whole
        pack's, summed over the shares. KTO's KL reference point is this micro-batch's estimate."""
        unpaired = self.objective.unpaired
        if unpaired != (mb.doc_tags is not None):
            raise ConfigError(_kind_mismatch(self.objective.loss_type, "this micro-batch's"))
        group = self.parallelizer.meshes.cp_group()
        output = self.model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False, return_token_losses=True)
        policy, nll_sum = sequence_logps(output, mb, group)
        reference = None
        mode = self.resolved_reference
        if mode == "precomputed":
            if dataset not in self._tables:
                raise RuntimeError(f"reference: precomputed, but no reference table was prepared for {dataset}")
            chosen, rejected = self._tables[dataset].lookup(mb.pack_index, pair_count(mb))
            reference = SequenceLogps(chosen, rejected, policy.chosen_tokens, policy.rejected_tokens)
        elif mode != "none":
            with torch.no_grad():
                if mode == "live":
                    ref_model = self._reference[0]
                    ref_out = ref_model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False,
                                        return_token_losses=True)  # fmt: skip
                else:
                    with adapters_disabled(self.model):
                        ref_out = self.model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False,
                                             return_token_losses=True)  # fmt: skip
                reference, _ = sequence_logps(ref_out, mb, group)
        if not unpaired:
            return output, self.objective.terms(policy, reference, nll_sum), policy
        labels = torch.tensor(mb.doc_tags[0 : 2 * pair_count(mb) : 2], dtype=torch.bool, device=self.device)
        kl = self.objective.kl_point(policy, reference) if self.objective.loss_type == "kto" else None
        return output, self.objective.terms(policy, reference, nll_sum, labels, kl), policy

    def _prepare_reference_tables(self) -> None:
        """``reference: precomputed``: read or compute the reference table of every preference set of the run.

        The sets are the training set (when fitting) and each validation set, all prepared at once, before the
        first step. A table found under ``<cache_dir>/reference`` with its key (reference weights, model config,
        numerics, data, code: :mod:`xtl.train.reference_cache`) by every rank is read; otherwise every rank takes
        part in one pass without gradient (each data-parallel rank forwards its share of the packs, the shares are
        gathered so that every rank holds the whole table), and local rank 0 stores it. The reference is the
        starting weights: under LoRA the model with its adapters off (its base never trains); otherwise the policy
        itself before its first step, and, on a run resumed from a checkpoint (the policy has moved), a frozen copy
        built as ``reference: live`` builds it, released after the pass.

        Raises:
            ConfigError: The run's data is not an :class:`~xtl.data.XTLDataModule`.
        """
        if self.resolved_reference != "precomputed":
            return
        datamodule = self.trainer.datamodule
        if not isinstance(datamodule, XTLDataModule):
            raise ConfigError(
                "model.init_args.reference: precomputed reads the pairs from xtl.data.XTLDataModule (the data: "
                "section of the recipe); with other data use reference: live"
            )
        datamodule.setup()
        sets: dict[str, PackedSplit] = {}
        if self.trainer.state.fn == "fit" and datamodule.train_split is not None:
            sets[TRAIN_SET] = datamodule.train_split
        for index, name in enumerate(datamodule.val_set_names):
            sets[f"val/{index}"] = datamodule.val_splits[name]
        missing = {name: split for name, split in sets.items() if split.pairs and name not in self._tables}
        if missing:
            keys = self._reference_keys(datamodule, missing)
            to_compute = self._read_reference_tables(missing, keys, datamodule.cache_dir)
            if to_compute:
                self._compute_reference_tables(datamodule, {name: missing[name] for name in to_compute}, keys)

    def _reference_keys(self, datamodule: XTLDataModule, sets: dict[str, PackedSplit]) -> dict[str, str]:
        """The cache key of each set's table: reference weights, model config, numerics, data, code."""
        memo = FileHashMemo(datamodule.cache_dir / "fingerprints")
        weights = weights_fingerprint(self.hf_dir, self.hparams.seed, memo) if self.global_rank == 0 else None
        common = {
            "weights": self.trainer.strategy.broadcast(weights, src=0),  # one rank reads the weights' files
            "model": dataclasses.asdict(self.model_config),
            "param_dtype": self.hparams.param_dtype,
            "precision": str(self.trainer.precision),
            "device": self.device.type,
            "transforms": [_describe(t) for t in self._transforms if t.transform_stage == TransformStage.MODEL],
            "pad_to": datamodule.pack_max_length if datamodule.pad_to_max_length else None,
        }
        return {
            name: reference_key({**common, "data": split.key}, code=(sequence_logps,)) for name, split in sets.items()
        }

    def _read_reference_tables(self, sets: dict[str, PackedSplit], keys: dict[str, str], cache_dir: Path) -> list[str]:
        """Take the stored tables every rank finds (a sharded forward needs every rank: all read or all compute);
        returns the sets left to compute."""
        stored = {
            name: load_reference_table(reference_table_path(cache_dir, keys[name]), keys[name], pair_offsets(s.plan))
            for name, s in sets.items()
        }
        everywhere = torch.tensor([float(table is not None) for table in stored.values()], device=self.device)
        group = self.parallelizer.data_group()
        if group is not None:
            dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=group)
        left = []
        for (name, table), found in zip(stored.items(), everywhere.tolist()):
            if table is None or not found:
                left.append(name)
                continue
            self._tables[name] = table.to(self.device)
            rank_zero_info(
                f"xtl preference: reference log-probabilities of {self._reference_set_name(name)} "
                f"({table.num_pairs} pairs) read from {reference_table_path(cache_dir, keys[name])}"
            )
        return left

    def _compute_reference_tables(
        self, datamodule: XTLDataModule, sets: dict[str, PackedSplit], keys: dict[str, str]
    ) -> None:
        """One pass over the packs of ``sets`` without gradient, sharded over the data-parallel ranks (every rank
        ends with the whole tables); local rank 0 stores them."""
        layout, group = self.parallelizer.layout, self.parallelizer.data_group()
        rank, world = layout.data_rank(self.global_rank), layout.dp_size
        collator, precision = datamodule.collator(), self.trainer.precision_plugin
        with self._reference_forward() as (forward, source):
            for name, split in sets.items():
                start = time.perf_counter()
                context = precision.train_step_context() if name == TRAIN_SET else precision.val_step_context()
                with context:  # the autocast of the step that reads the table, as the live reference runs under
                    table = compute_reference_table(
                        split.packs,
                        pair_offsets(split.plan),
                        lambda pack: collator([pack])[0],
                        forward,
                        rank=rank,
                        world_size=world,
                        group=group,
                        device=self.device,
                    )
                self._tables[name] = table
                path = reference_table_path(datamodule.cache_dir, keys[name])
                if self.trainer.local_rank == 0:
                    info = {"set": self._reference_set_name(name), "pairs": table.num_pairs}
                    try:
                        save_reference_table(path, table, keys[name], info)
                    except OSError as err:  # a read-only cache folder: computed again next time
                        rank_zero_info(f"xtl preference: cannot store the reference table in {path} ({err})")
                rank_zero_info(
                    f"xtl preference: reference log-probabilities of {self._reference_set_name(name)} "
                    f"({table.num_pairs} pairs, {len(split.plan)} packs on {world} rank(s), from {source}) computed "
                    f"in {time.perf_counter() - start:.1f} s, stored in {path}"
                )

    @contextmanager
    def _reference_forward(self) -> Iterator[tuple[ReferenceForward, str]]:
        """The forward that computes reference log-probabilities for a table, without gradient, in eval mode (as
        the live reference), and what it runs."""
        temporary: BaseModel | None = None
        context: Any = nullcontext()
        resumed = self._trainer is not None and self._trainer.ckpt_path is not None
        if any(True for _ in lora_layers(self.model)):
            model, source, context = self.model, "the model with its LoRA adapters off", adapters_disabled(self.model)
        elif not resumed and self.global_step == 0:
            model, source = self.model, "the policy before its first step"
        else:
            temporary = model = self.build_frozen_copy()
            source = "a copy of the starting weights, the resumed policy has moved"
        modes = [(module, module.training) for module in model.modules()]
        model.eval()

        def forward(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
            out = model(seq_ctx=mb.seq_ctx, labels=mb.labels, return_logits=False, return_token_losses=True)
            logps, _ = sequence_logps(out, mb)
            return logps.chosen, logps.rejected

        try:
            with context, torch.no_grad():
                yield forward, source
        finally:
            for module, training in modes:
                module.training = training
            if temporary is not None:
                del model, temporary, modes
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def _check_data_kinds(self, datamodule: XTLDataModule) -> None:
        """Refuse sets of the kind the objective does not train on (a chat set, pairs for KTO, rows for DPO)."""
        want = UNPAIRED_KIND if self.objective.unpaired else PREFERENCE_KIND
        sets = [("data.sources", datamodule.sources)]
        sets += [(f"data.val_sources.{name}", specs) for name, specs in datamodule.val_sources.items()]
        for key, specs in sets:
            other = sorted({spec.kind for spec in specs} - {want})
            if other:
                raise ConfigError(_kind_mismatch(self.objective.loss_type, f"{key} has kind: {other[0]};"))

    def _reference_set_name(self, name: str) -> str:
        return name if name == TRAIN_SET else f"val set {self._set_name('val', int(name.split('/')[1]))}"

    def _preference_metrics(self, sets: nn.ModuleDict, dataloader_idx: int) -> nn.ModuleDict:
        key = str(dataloader_idx)
        if key not in sets:
            names = ("loss", "pairs", *self.objective.metric_sums)
            sets[key] = nn.ModuleDict({n: torchmetrics.SumMetric().to(self.device) for n in names})
        return sets[key]


def _describe(transform: Any) -> dict[str, Any]:
    """A model transform's class and plain settings (what may change the reference's numerics), for cache keys."""
    plain = (str, int, float, bool, type(None), list, tuple)
    settings = {k: v for k, v in vars(transform).items() if not k.startswith("_") and isinstance(v, plain)}
    return {"class": f"{type(transform).__module__}.{type(transform).__qualname__}", **settings}


class _AllReduceSum(torch.autograd.Function):
    """Sum over a process group; the gradient of each rank's input is the sum of every rank's output gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


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
