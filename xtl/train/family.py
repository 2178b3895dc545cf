"""Family records: what training a model family needs beyond the next-token loss.

The family is chosen once, by the model config (:func:`family_of`: routed experts, a vision tower), and one
:class:`~xtl.train.LanguageModule` trains every family. The record says what the family adds to the step:

- its parts (``BaseModel.parameter_parts``: ``language``, plus ``vision`` and ``merger`` for vision-language
  models), which ``freeze`` and ``optimizer.lr_scales`` name;
- its training behaviours (:class:`FamilyTraining`): extra losses of each micro-batch, an update after the
  optimizer step and the metrics of the step. Models with routed experts get :class:`RouterTraining`'s router
  losses, router metrics and the aux-loss-free bias update, set by ``model.init_args.routing``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from xtl.errors import ConfigError
from xtl.model import BaseModel, ModelOutput, TransformerConfig
from xtl.ops.moe_loss import balance_loss, z_loss


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


class FamilyTraining:
    """One training behaviour of a family: every hook does nothing by default."""

    def start_step(self, num_micro_batches: int, device: torch.device) -> None:
        """A step over ``num_micro_batches`` micro-batches begins."""

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
        self.balance_loss_coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if coef is None else coef
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
    if not family.routed_experts:
        if routing is not None:
            model_type = getattr(config.hf_config_class, "model_type", type(config).__name__)
            raise ConfigError(
                f"model.init_args.routing: {model_type} has no routed experts (a {family.name} model); remove routing"
            )
        return []
    return [RouterLosses(routing or RouterTraining(), config)]
