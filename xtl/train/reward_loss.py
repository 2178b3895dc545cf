"""The Bradley-Terry reward objective over pairs of scalar rewards, as TRL's ``RewardTrainer`` computes it.

A pair's loss is ``-log sigmoid(r_chosen - r_rejected - margin)`` plus, with ``center_rewards_coefficient``, that
coefficient times ``(r_chosen + r_rejected) ** 2`` (the centering regularizer of Eisenstein et al., 2023, which keeps
the rewards near zero). TRL takes the mean of each term over its batch; here the sums are over pairs, and the step
divides them by the pairs of the whole step (all micro-batches and data-parallel ranks), which for one batch is TRL's
mean. The logged metrics are TRL's ``accuracy`` (``r_chosen > r_rejected``) and ``margin`` (``r_chosen - r_rejected``)
with the mean rewards of each side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from xtl.errors import ConfigError

REWARD_METRICS = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")


@dataclass
class RewardTerms:
    """What a batch of pairs contributes to the step, as sums over its pairs (divided by the step's pairs later).

    Attributes:
        loss_sum: Sum over pairs of the pair loss (with gradient).
        metric_sums: Sums over pairs of each of :data:`REWARD_METRICS` (detached).
    """

    loss_sum: torch.Tensor
    metric_sums: dict[str, torch.Tensor]


@dataclass
class RewardLoss:
    """The reward model's objective (``model.init_args.objective``).

    Attributes:
        center_rewards_coefficient: Weight of the centering term ``(r_chosen + r_rejected) ** 2`` (TRL's
            ``center_rewards_coefficient``; its paper suggests 0.01); ``None`` or 0: none.
    """

    center_rewards_coefficient: float | None = None

    def __post_init__(self) -> None:
        value = self.center_rewards_coefficient
        if value is not None and not value >= 0:
            raise ConfigError(f"model.init_args.objective.center_rewards_coefficient must be >= 0, got {value}")

    def terms(self, chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None) -> RewardTerms:
        """The loss and metric sums of a batch of pairs.

        Args:
            chosen: The reward of each pair's chosen sequence ``(P,)`` (with gradient).
            rejected: The reward of each pair's rejected sequence ``(P,)``.
            margin: The margin each pair's chosen reward should exceed the rejected one by ``(P,)`` (``None``: 0).
        """
        chosen, rejected = _upcast(chosen), _upcast(rejected)
        difference = chosen - rejected
        shifted = difference if margin is None else difference - margin.to(difference)
        losses = -F.logsigmoid(shifted)
        if self.center_rewards_coefficient:
            losses = losses + self.center_rewards_coefficient * (chosen + rejected) ** 2
        metrics = {
            "accuracy": (chosen > rejected).to(chosen.dtype).sum(),
            "margin": difference.sum(),
            "rewards/chosen": chosen.sum(),
            "rewards/rejected": rejected.sum(),
        }
        return RewardTerms(losses.sum(), {k: v.detach() for k, v in metrics.items()})

    @staticmethod
    def metric_means(sums: dict[str, torch.Tensor], pairs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The logged metrics (:data:`REWARD_METRICS`) from their totals over ``pairs`` pairs."""
        return {k: sums[k] / pairs.clamp(min=1) for k in REWARD_METRICS}


def _upcast(values: torch.Tensor) -> torch.Tensor:
    """fp32 (fp64 stays fp64)."""
    return values.to(torch.promote_types(values.dtype, torch.float32))
