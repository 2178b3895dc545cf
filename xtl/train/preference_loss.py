"""Preference objectives over pairs of sequence log-probabilities: DPO (sigmoid, hinge, IPO, robust), SimPO and ORPO.

Every objective is a function of per-sequence log-probabilities of the chosen and the rejected response of each pair
(summed over the response tokens, with their token counts), of the policy and, for the DPO family, of a frozen
reference. The formulas are those of TRL (``DPOTrainer``; ``CPOTrainer`` with ``loss_type: simpo``; ``ORPOTrainer``),
so a batch gives TRL's loss and reward metrics; the sums here are over pairs and tokens, and the step divides them by
the pair and token counts of the whole step (all micro-batches and data-parallel ranks), which for one batch is TRL's
mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from xtl.errors import ConfigError

LossType = Literal["sigmoid", "hinge", "ipo", "robust", "simpo", "orpo"]
REFERENCE_FREE: frozenset[str] = frozenset({"simpo", "orpo"})
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@dataclass
class SequenceLogps:
    """Per-sequence log-probabilities of the responses of a batch of pairs.

    Attributes:
        chosen: Summed log-probability of each chosen response ``(P,)``, fp32.
        rejected: Summed log-probability of each rejected response ``(P,)``.
        chosen_tokens: Response tokens of each chosen response ``(P,)``.
        rejected_tokens: Response tokens of each rejected response ``(P,)``.
    """

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


@dataclass
class PairTerms:
    """What a batch of pairs contributes to the step, as sums (divided by the step's counts later).

    Attributes:
        loss_sum: Sum over pairs of the per-pair loss (with gradient).
        nll_sum: Sum over chosen response tokens of their cross-entropy (with gradient; used by ``rpo_alpha`` and
            ORPO).
        metric_sums: Sums over pairs of each of :data:`METRICS` (detached).
    """

    loss_sum: torch.Tensor
    nll_sum: torch.Tensor
    metric_sums: dict[str, torch.Tensor]


@dataclass
class PreferenceLoss:
    """A preference objective (``model.init_args.objective``).

    Attributes:
        loss_type: ``sigmoid`` (DPO), ``hinge`` (SLiC), ``ipo`` (length-normalized, as TRL), ``robust``
            (label-smoothed, unbiased), ``simpo`` (reference-free, length-normalized, target margin ``gamma``) or
            ``orpo`` (reference-free odds ratio plus the chosen responses' NLL).
        beta: Temperature of the implicit reward (IPO: the regularization tau; ORPO: the odds-ratio weight lambda).
        label_smoothing: Probability that a pair's preference is flipped (``sigmoid``/``simpo``: conservative DPO;
            ``robust``: the unbiased loss; in ``[0, 0.5)``).
        gamma: SimPO's target reward margin (TRL's ``simpo_gamma``).
        rpo_alpha: Weight of an NLL term on the chosen responses (RPO; TRL's ``sft`` loss, or CPO's ``cpo_alpha``
            with ``simpo``); ``None`` or 0: none. ORPO always has its NLL term with weight 1.
    """

    loss_type: LossType = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    rpo_alpha: float | None = None

    def __post_init__(self) -> None:
        key = "model.init_args.objective"
        kinds = ("sigmoid", "hinge", "ipo", "robust", "simpo", "orpo")
        if self.loss_type not in kinds:
            raise ConfigError(f"{key}.loss_type: {self.loss_type!r} is not one of {', '.join(kinds)}")
        if not self.beta > 0:
            raise ConfigError(f"{key}.beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"{key}.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust", "simpo"):
            raise ConfigError(f"{key}.label_smoothing applies to sigmoid, robust and simpo, not {self.loss_type}")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model (the DPO family) or not (SimPO, ORPO)."""
        return self.loss_type not in REFERENCE_FREE

    @property
    def nll_weight(self) -> float:
        """Weight of the chosen responses' mean NLL in the loss."""
        return 1.0 if self.loss_type == "orpo" else float(self.rpo_alpha or 0.0)

    def terms(self, policy: SequenceLogps, reference: SequenceLogps | None, nll_sum: torch.Tensor) -> PairTerms:
        """The loss and metric sums of a batch of pairs.

        Args:
            policy: The policy's log-probabilities (with gradient).
            reference: The reference's (``None`` for SimPO and ORPO).
            nll_sum: Sum of the chosen response tokens' cross-entropy (with gradient).
        """
        if self.needs_reference and reference is None:
            raise ValueError(f"loss_type {self.loss_type!r} needs reference log-probabilities")
        beta, smoothing = self.beta, self.label_smoothing
        chosen, rejected = _upcast(policy.chosen), _upcast(policy.rejected)
        if self.loss_type in REFERENCE_FREE:  # average log-probability per response token
            chosen = chosen / policy.chosen_tokens.clamp(min=1)
            rejected = rejected / policy.rejected_tokens.clamp(min=1)
            chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
            if self.loss_type == "simpo":
                logits = chosen - rejected - self.gamma / beta
                losses = -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
            else:  # ORPO: minus lambda * log sigmoid(log odds ratio); the NLL term is added by the step
                log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
                losses = -beta * F.logsigmoid(log_odds)
        else:
            chosen_ratio = chosen - _upcast(reference.chosen)
            rejected_ratio = rejected - _upcast(reference.rejected)
            chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
            delta = chosen_ratio - rejected_ratio
            if self.loss_type == "sigmoid":
                losses = -F.logsigmoid(beta * delta) * (1 - smoothing) - F.logsigmoid(-beta * delta) * smoothing
            elif self.loss_type == "hinge":
                losses = torch.relu(1 - beta * delta)
            elif self.loss_type == "ipo":
                per_token = chosen_ratio / policy.chosen_tokens.clamp(min=1)
                per_token = per_token - rejected_ratio / policy.rejected_tokens.clamp(min=1)
                losses = (per_token - 1 / (2 * beta)) ** 2
            else:  # robust
                clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
                flipped = -smoothing * F.logsigmoid(-beta * delta)
                losses = (clean - flipped) / (1 - 2 * smoothing)
        metrics = {
            "rewards/chosen": chosen_rewards.sum(),
            "rewards/rejected": rejected_rewards.sum(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
            "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
            "logps/chosen": chosen.detach().sum(),
            "logps/rejected": rejected.detach().sum(),
        }
        return PairTerms(losses.sum(), nll_sum, metrics)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or in its own dtype when wider (fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2``."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


torch.serialization.add_safe_globals([PreferenceLoss])  # a hyperparameter in checkpoints (weights_only loads)
