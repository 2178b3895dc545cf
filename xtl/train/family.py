"""Family records: what training a model family needs beyond the next-token loss.

The family is chosen once, by the model config (:func:`family_of`: routed experts, a vision tower), and one
:class:`~xtl.train.LanguageModule` trains every family. The record says what the family adds to the step:

- its parts (``BaseModel.parameter_parts``: ``language``, plus ``vision`` and ``merger`` for vision-language
  models), which ``freeze`` and ``optimizer.lr_scales`` name;
- its training behaviours (:class:`FamilyTraining`): extra losses of each micro-batch, an update after the
  optimizer step and the metrics of the step. Models with routed experts get :class:`RouterTraining`'s router
  losses, router metrics and the aux-loss-free bias update, set by ``model.init_args.routing``; models with
  multi-token-prediction depths (DeepSeek-V3 ``mtp_layers``) get :class:`MTPLosses`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from xtl.errors import ConfigError
from xtl.model import BaseModel, ModelOutput, TransformerConfig
from xtl.module.mtp import mtp_target_counts
from xtl.ops.moe_loss import balance_loss, z_loss
from xtl.strategies.capability import ContextParallelFeature


@dataclass(frozen=True)
class Family:
    """A model family as training sees it.

    Attributes:
        name: ``dense``, ``moe``, ``vision`` or ``vision-moe``.
        routed_experts: The language model routes tokens to experts.
        vision: The model has a vision tower.
        parts: The names of the model's parts (``BaseModel.parameter_parts``), which ``freeze`` and
            ``optimizer.lr_scales`` name.
    """

    name: str
    routed_experts: bool
    vision: bool
    parts: tuple[str, ...] = ("language",)


@dataclass
class RouterTraining:
    """How models with routed experts train their routers (``model.init_args.routing``).

    Router statistics are normalized globally like the cross-entropy: each micro-batch's expert loads and token
    count are summed over the data-parallel ranks before the losses are formed, so the balancing term sees the whole
    data-parallel micro-batch; the terms are averaged over the step's micro-batches. After each optimizer step,
    routers with a score-correction bias (DeepSeek-V3's aux-loss-free balancing) move it by ``bias_update_lr``
    towards balance from the step's summed expert loads; other routers have no such bias and are left alone.

    Logged each step: ``train/balance_loss``, ``train/z_loss`` and ``train/maxvio`` (mean over MoE layers of
    ``(max load - mean load) / mean load``).

    Attributes:
        balance_loss_coef: Weight of the load-balancing loss (``None``: the config's ``router_aux_loss_coef``).
        z_loss_coef: Weight of the router z-loss.
        bias_update_lr: Step of the aux-loss-free bias update (0 disables it).
    """

    balance_loss_coef: float | None = None
    z_loss_coef: float = 0.0
    bias_update_lr: float = 1e-3


torch.serialization.add_safe_globals([RouterTraining])  # a hyperparameter in checkpoints (weights_only loads)


@dataclass
class DataRanks:
    """The data-parallel ranks of the step, as a family behaviour needs them.

    Attributes:
        size: Ranks reading different data (the gradient reduction averages over them).
        sum: Sums a tensor in place over those ranks and returns it (identity on one rank).
    """

    size: int
    sum: Callable[[torch.Tensor], torch.Tensor]


class FamilyTraining(ContextParallelFeature):
    """One training behaviour of a family: every hook does nothing by default, and it runs under context
    parallelism unless it declares otherwise (:meth:`context_parallel_refusal`)."""

    def start_step(self, num_micro_batches: int, device: torch.device) -> None:
        """A step over ``num_micro_batches`` micro-batches begins."""

    def count_step(self, micro_batches: Sequence[Any], ranks: DataRanks) -> None:
        """Count what the step's losses are normalized by, before the first forward (``micro_batches``: this rank's
        :class:`~xtl.data.collate.MicroBatch` es)."""

    def extra_loss(self, output: ModelOutput, ranks: DataRanks) -> torch.Tensor | None:
        """A term added to a micro-batch's loss (scaled like the summed cross-entropy), or ``None``."""
        return None

    def after_optimizer_step(
        self, model: BaseModel, outputs: list[dict[str, Any]], applied: torch.Tensor, ranks: DataRanks
    ) -> None:
        """After the optimizer step.

        Args:
            model: The trained model.
            outputs: The ``extras`` of each micro-batch's output.
            applied: 1.0 when the update was applied, 0.0 when it was skipped (a device tensor: scale by it rather
                than branch on it).
            ranks: The data-parallel ranks.
        """

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """Values of the step to log as ``train/<name>``."""
        return {}


class RouterLosses(FamilyTraining):
    """:class:`RouterTraining` at work: balance and z losses, router metrics and the bias update.

    Args:
        settings: The ``routing`` settings.
        config: The model config (its ``router_aux_loss_coef`` when ``balance_loss_coef`` is unset).
    """

    def __init__(self, settings: RouterTraining, config: TransformerConfig) -> None:
        self.settings = settings
        coef = settings.balance_loss_coef
        self.balance_loss_coef = float(config.router_aux_loss_coef or 0.0) if coef is None else coef
        self._num_micro_batches = 1
        self._log: dict[str, torch.Tensor] = {}

    def start_step(self, num_micro_batches: int, device: torch.device) -> None:
        """Reset the step's router metrics."""
        self._num_micro_batches = max(1, num_micro_batches)
        self._log = {k: torch.zeros((), device=device) for k in ("balance_loss", "z_loss")}

    def extra_loss(self, output: ModelOutput, ranks: DataRanks) -> torch.Tensor | None:
        """Balance and z losses of one micro-batch, globally normalized across data-parallel ranks."""
        extras = output.extras
        if "router_prob_sum" not in extras:
            return None
        counts = torch.cat([extras["tokens_per_expert"].float().flatten(), extras["router_num_tokens"].float()[None]])
        counts = ranks.sum(counts)
        tokens_per_expert = counts[:-1].view_as(extras["tokens_per_expert"])
        num_tokens = counts[-1]
        bal = balance_loss(extras["router_prob_sum"], tokens_per_expert, num_tokens)
        z = z_loss(extras["router_z_sum"], num_tokens)
        self._log["balance_loss"] += bal.detach().float() / self._num_micro_batches
        self._log["z_loss"] += z.detach().float() / self._num_micro_batches
        scale = ranks.size / self._num_micro_batches
        return scale * (self.balance_loss_coef * bal + self.settings.z_loss_coef * z)

    def after_optimizer_step(
        self, model: BaseModel, outputs: list[dict[str, Any]], applied: torch.Tensor, ranks: DataRanks
    ) -> None:
        """The max-violation metric from the step's expert loads, the logged losses summed over the data ranks (each
        rank holds its tokens' share of them), and the bias update (none on a skipped step)."""
        loads = [out["tokens_per_expert"] for out in outputs if "tokens_per_expert" in out]
        if not loads:
            return
        local = torch.stack(loads).sum(0).float()
        shares = torch.stack(
            [self._log.get(k, local.new_zeros(())).to(local.device) for k in ("balance_loss", "z_loss")]
        )
        summed = ranks.sum(torch.cat([local.flatten(), shares]))
        total = summed[:-2].view_as(local)
        self._log["balance_loss"], self._log["z_loss"] = summed[-2], summed[-1]
        mean = total.mean(dim=-1, keepdim=True).clamp(min=1e-9)
        self._log["maxvio"] = ((total.max(dim=-1, keepdim=True).values - mean) / mean).mean()
        if self.settings.bias_update_lr > 0:
            model.update_router_bias(total, self.settings.bias_update_lr * applied)

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """``balance_loss``, ``z_loss`` and (once the step is done) ``maxvio``."""
        return dict(self._log)


class MTPLosses(FamilyTraining):
    """Multi-token prediction: each depth's cross-entropy, normalized like the next-token loss, weighted into it.

    Depth ``k``'s loss is its summed cross-entropy over the step divided by the positions it scores in the step
    over all micro-batches and data-parallel ranks (counted from the micro-batches' targets before the first
    forward, as the next-token loss counts its tokens), so gradient accumulation and data parallelism leave it
    unchanged. The term added to the training loss is ``weight`` times the mean over depths. Logged each step:
    ``train/mtp_loss_<k>`` (``train/loss`` stays the next-token loss).

    Under context parallelism each rank scores its share's positions, the last ``k`` of them on the next share's
    tokens and labels, which the share carries (:func:`~xtl.module.mtp.shifted_targets`); the counts and sums are
    added over the data group, which holds the context-parallel ranks, so the step's losses are those of the whole
    packs.

    Args:
        depths: MTP depths of the model.
        weight: The config's ``mtp_loss_weight``.
    """

    def __init__(self, depths: int, weight: float) -> None:
        self.depths = depths
        self.weight = weight
        self._tokens: torch.Tensor | None = None
        self._sums: torch.Tensor | None = None
        self._log: dict[str, torch.Tensor] = {}

    def start_step(self, num_micro_batches: int, device: torch.device) -> None:
        """Reset the step's loss sums."""
        self._sums = torch.zeros(self.depths, device=device)
        self._log = {}

    def count_step(self, micro_batches: Sequence[Any], ranks: DataRanks) -> None:
        """The positions each depth scores in the step, summed over the micro-batches and the data ranks."""
        counts = torch.zeros(self.depths, device=self._sums.device)
        for mb in micro_batches:
            counts += mtp_target_counts(mb.labels, mb.seq_ctx.position_ids, self.depths, mb.seq_ctx).to(counts.device)
        self._tokens = ranks.sum(counts)

    def extra_loss(self, output: ModelOutput, ranks: DataRanks) -> torch.Tensor | None:
        """``weight / depths * sum_k loss_sum_k / tokens_k``, scaled like the next-token loss."""
        sums = output.extras.get("mtp_loss_sum")
        if sums is None:
            return None
        self._sums += sums.detach().float()
        per_depth = sums.float() / self._tokens.clamp(min=1)
        return per_depth.sum() * (self.weight / self.depths * ranks.size)

    def after_optimizer_step(
        self, model: BaseModel, outputs: list[dict[str, Any]], applied: torch.Tensor, ranks: DataRanks
    ) -> None:
        """Each depth's mean cross-entropy over the step (the loss sums added over the data ranks)."""
        if self._tokens is None:
            return
        means = ranks.sum(self._sums.clone()) / self._tokens.clamp(min=1)
        self._log = {f"mtp_loss_{k}": means[k - 1] for k in range(1, self.depths + 1)}

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """``mtp_loss_<k>`` of every depth (once the step is done)."""
        return dict(self._log)


def family_of(config: TransformerConfig) -> Family:
    """The family of a model config (a vision-language model's language model decides ``routed_experts``)."""
    experts, vision = bool(config.routed_experts), bool(config.vision_language)
    name = {(False, False): "dense", (True, False): "moe", (False, True): "vision", (True, True): "vision-moe"}
    return Family(
        name[experts, vision], experts, vision, ("vision", "merger", "language") if vision else ("language",)
    )


def family_training(config: TransformerConfig, routing: RouterTraining | None) -> list[FamilyTraining]:
    """The training behaviours of ``config``'s family, with the module's ``routing`` settings.

    Raises:
        ConfigError: ``routing`` is set for a model without routed experts.
    """
    family = family_of(config)
    depths = config.mtp_layers
    mtp = [MTPLosses(depths, float(config.mtp_loss_weight))] if depths else []
    if not family.routed_experts:
        if routing is not None:
            raise ConfigError(
                f"model.init_args.routing: {config.model_type} has no routed experts (a {family.name} model); "
                "remove routing"
            )
        return mtp
    return [RouterLosses(routing or RouterTraining(), config), *mtp]
