"""Reward modelling: :class:`RewardModule` trains a Bradley-Terry reward model of any text family on preference pairs.

The model is the family's body with a scalar sequence-classification head in place of the LM head (the model config's
``num_labels: 1``; transformers' ``*ForSequenceClassification`` with its ``score``). A training micro-batch is a
packed preference micro-batch (``kind: preference``: documents chosen, rejected, chosen, rejected, ...,
:mod:`xtl.train.preference`); one forward runs the body over the pack and the head on each document's last token only,
where transformers' ``*ForSequenceClassification`` reads a right-padded sequence's reward (its last non-pad token).
The loss (:mod:`xtl.train.reward_loss`, TRL's ``RewardTrainer``) is normalized over the pairs of the whole step, over
micro-batches and data-parallel ranks, as :class:`~xtl.train.PreferenceModule` normalizes its own.

Started from a causal LM (an SFT export) the head is new: it is initialized as transformers initializes it (normal,
``initializer_range``) from the module's ``seed``, and the checkpoint's LM head is left unread. Started from a
``*ForSequenceClassification`` checkpoint with one label (a reward export) the head is loaded. ``HFExport`` writes a
``*ForSequenceClassification`` directory (``architectures``, ``num_labels: 1``, the tokenizer's ``pad_token_id``) that
``transformers.AutoModelForSequenceClassification`` loads and scores as xtl does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from xtl.batch import ModelOutput
from xtl.data.collate import MicroBatch
from xtl.data.datamodule import XTLDataModule
from xtl.data.preference import PREFERENCE_KIND
from xtl.errors import ConfigError
from xtl.train.base import LanguageModule
from xtl.train.preference import PairMetrics, pair_count
from xtl.train.reward_loss import REWARD_METRICS, RewardLoss, RewardTerms
from xtl.train.scorer import document_sums


class RewardModule(PairMetrics, LanguageModule):
    """Trains a reward model (a scalar head on an xtl model of any text family) on preference pairs with TRL's
    Bradley-Terry loss.

    Logged on train and validation (``val/<set>/...`` for several held-out sets): ``loss``, ``accuracy`` (the share of
    pairs whose chosen reward is the higher), ``margin`` (the mean of chosen minus rejected reward),
    ``rewards/chosen`` and ``rewards/rejected`` (means over pairs).

    Args:
        model: As :class:`~xtl.train.LanguageModule`: a causal LM (typically the SFT run's HF export; its head is
            replaced by a new scalar head) or a ``*ForSequenceClassification`` checkpoint with one label (its head is
            loaded).
        objective: The loss's settings (:class:`~xtl.train.reward_loss.RewardLoss`: the centering coefficient).
        **kwargs: The other arguments of :class:`~xtl.train.LanguageModule` (``seed`` also seeds a new head).

    Raises:
        ConfigError: A vision-language model; a sequence-classification checkpoint with more than one label; data
            that is not ``kind: preference``; a score head that does not train (frozen by ``freeze`` or a model
            transform such as LoRA).
    """

    objective = "reward model"
    trains_mtp = False  # multi-token prediction belongs to next-token training
    scores_sequences = True

    def __init__(self, model: str | dict[str, Any], objective: RewardLoss = RewardLoss(), **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        config = self.model_config
        if self.family.vision:
            raise ConfigError(
                f"model.init_args.model: RewardModule trains text models; {config.model_type} is a vision-language "
                "model, and transformers has no sequence-classification class to load its export: train the reward "
                "model on a text model, or score vision-language rollouts with a rule judger (xtl.rl.ExactMatchJudger)"
            )
        if config.num_labels > 1:
            raise ConfigError(
                f"model.init_args.model: a reward model has one output; the checkpoint is a classifier with "
                f"num_labels {config.num_labels}: start from a causal LM or a reward model"
            )
        self.head_is_new = not config.num_labels or self.hf_dir is None
        # a scalar head (transformers' ``score``), never tied to the embedding
        self.model_config = dataclasses.replace(config, num_labels=1, tie_word_embeddings=False)
        self.objective = objective

    # ---- model -----------------------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Build and load the model (:meth:`LanguageModule.configure_model`); a new head is initialized from
        ``seed`` (normal, ``initializer_range``, as transformers does) whatever the load left in it.

        Raises:
            ConfigError: The head does not train (frozen).
        """
        if self.model is not None:
            return
        super().configure_model()
        head = self.model.text_model().lm_head
        if self.head_is_new:
            names = [name for name, tensor in self.model.checkpoint_tensors().items() if tensor is head.weight]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.hparams.seed)
                self.model.init_tensors(names)
        if not all(param.requires_grad for param in head.parameters()):
            raise ConfigError(
                "RewardModule: the score head is frozen (model.init_args.freeze, or a model transform such as LoRA "
                "that trains adapters only); a reward model trains its head: leave it trainable"
            )

    def on_fit_start(self) -> None:
        """Say what trains and where the head comes from."""
        coefficient = self.objective.center_rewards_coefficient
        source = f"new, initialized (seed {self.hparams.seed})" if self.head_is_new else f"loaded from {self.hf_dir}"
        rank_zero_info(
            f"xtl reward: Bradley-Terry loss (center_rewards_coefficient {coefficient}), scalar head {source}"
        )

    def setup(self, stage: str) -> None:
        """Refuse data that is not preference pairs."""
        super().setup(stage)
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        if isinstance(datamodule, XTLDataModule):
            self._check_data_kinds(datamodule)

    def pair_rewards(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, ModelOutput]:
        """The reward of every pair's chosen and rejected document of a micro-batch, and the model's output.

        The head runs on each document's last token only. Under context parallelism a share scores the last tokens
        it holds and the rewards are made whole over the group (differentiably,
        :func:`~xtl.train.scorer.document_sums`).

        Returns:
            ``(chosen, rejected, output)``: ``(P,)`` rewards (fp32, fp64 for an fp64 model) with gradient.
        """
        ctx = mb.seq_ctx
        docs = 2 * pair_count(mb)
        length = ctx.input_ids.shape[1] if ctx.input_ids is not None else ctx.inputs_embeds.shape[1]
        ends = [end - 1 for end in ctx.doc_bounds[1 : docs + 1]]
        held = [end for end in ends if 0 <= end - ctx.share_start < length]
        local = torch.tensor([end - ctx.share_start for end in held], dtype=torch.long).to(self.device)
        output = self.model(seq_ctx=ctx, return_logits=True, logits_to_keep=local)
        scores = output.logits[0, :, 0]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        positions = torch.tensor(held, dtype=torch.long).to(self.device)
        rewards = document_sums(scores, positions, ctx, docs, self.parallelizer.meshes.cp_group())
        return rewards[0::2], rewards[1::2], output

    # ---- training --------------------------------------------------------------------------------------------

    def training_step(self, batch: list[Any], batch_idx: int) -> torch.Tensor:
        """One optimizer step over this rank's preference micro-batches (:meth:`step_objective`)."""
        forward, sums = self.step_objective(batch)
        result = self.optimizer_step_over(batch, forward, pair_count)
        zero = torch.zeros((), device=self.device)
        totals = self._sum_over_data_ranks(torch.stack([sum((s[k] for s in sums), zero) for k in REWARD_METRICS]))
        means = self.objective.metric_means(dict(zip(REWARD_METRICS, totals)), result.global_tokens)
        self.log_step_metrics({f"train/{k}": v for k, v in means.items()})
        return result.loss_sum / result.global_tokens.clamp(min=1)

    def step_objective(
        self, batch: list[MicroBatch]
    ) -> tuple[Callable[[MicroBatch], ModelOutput], list[dict[str, torch.Tensor]]]:
        """The objective of one step: a micro-batch's forward, whose ``loss_sum`` (the sum of its pair losses) the
        step divides by the step's pairs (:func:`~xtl.train.preference.pair_count`, over micro-batches and
        data-parallel ranks), and the list its metric sums are appended to. Under context parallelism every rank of
        a group holds the whole pack's rewards (and counts its pairs)."""
        sums: list[dict[str, torch.Tensor]] = []

        def forward(mb: MicroBatch) -> ModelOutput:
            terms, output = self._terms(mb)
            sums.append(terms.metric_sums)
            return ModelOutput(loss_sum=terms.loss_sum, num_tokens=None, extras=output.extras)

        return forward, sums

    # ---- validation ------------------------------------------------------------------------------------------

    def validation_step(self, batch: list[Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Accumulate the pairs' loss and metric sums of one held-out set (torchmetrics, synced across ranks)."""
        metrics = self.pair_metrics(dataloader_idx, REWARD_METRICS)
        with torch.no_grad():
            for mb, real in self.eval_micro_batches(batch):
                if not real or pair_count(mb) == 0:  # every rank runs as many forwards (sharded parameters)
                    self.model(seq_ctx=mb.seq_ctx, return_logits=False)
                    continue
                terms, _ = self._terms(mb)
                metrics["loss"].update(terms.loss_sum.detach())
                metrics["pairs"].update(torch.tensor(float(pair_count(mb)), device=self.device))
                for key in REWARD_METRICS:
                    metrics[key].update(terms.metric_sums[key])
        self.join_metric_sync(metrics)

    def on_validation_epoch_end(self) -> None:
        """Log ``val/loss``, ``val/accuracy``, ``val/margin`` and ``val/rewards/...`` (``val/<set>/...`` for
        several sets)."""
        self.log_pair_metrics()

    def test_step(self, batch: list[Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Not supported: a reward model is evaluated on held-out pairs (``data.val_sources``)."""
        raise ConfigError("RewardModule evaluates held-out pairs through data.val_sources (xtl validate), not test")

    def predict_step(self, batch: list[dict[str, Any]], batch_idx: int, dataloader_idx: int = 0) -> list[dict]:
        """Not supported: a reward model scores sequences, it does not generate."""
        raise ConfigError("RewardModule: a reward model scores sequences and does not generate; predict needs an LM")

    # ---- private ---------------------------------------------------------------------------------------------

    def _terms(self, mb: MicroBatch) -> tuple[RewardTerms, ModelOutput]:
        chosen, rejected, output = self.pair_rewards(mb)
        return self.objective.terms(chosen, rejected, pair_margins(mb, chosen)), output

    def _check_data_kinds(self, datamodule: XTLDataModule) -> None:
        """Refuse training and held-out sets that are not preference pairs."""
        sets = [("data.sources", datamodule.sources)]
        sets += [(f"data.val_sources.{name}", specs) for name, specs in datamodule.val_sources.items()]
        for key, specs in sets:
            other = sorted({spec.kind for spec in specs} - {PREFERENCE_KIND})
            if other:
                raise ConfigError(
                    f"{key} has kind: {other[0]}; RewardModule trains on chosen/rejected pairs: set kind: "
                    f"{PREFERENCE_KIND} on the sources"
                )


def pair_margins(mb: MicroBatch, like: torch.Tensor) -> torch.Tensor | None:
    """The margin of every pair of a micro-batch (``margin_key`` sources: each document's tag; ``None`` without
    margins), as ``like``'s dtype and device."""
    if mb.doc_tags is None:
        return None
    return torch.tensor(mb.doc_tags[0 : 2 * pair_count(mb) : 2], dtype=like.dtype, device=like.device)
