"""Preference objectives over pairs of sequence log-probabilities: DPO (sigmoid, hinge, IPO, robust), SimPO, ORPO and
KTO.

Every objective is a function of per-sequence log-probabilities of the chosen and the rejected response of each pair
(summed over the response tokens, with their token counts), of the policy and, for the DPO family and KTO, of a frozen
reference. KTO's "pairs" are a row's own completion and a mismatched one (:mod:`xtl.data.unpaired`), with the row's
label. The formulas are those of TRL (``DPOTrainer``; ``CPOTrainer`` with ``loss_type: simpo``; ``ORPOTrainer``;
``KTOTrainer``), so a batch gives TRL's loss and reward metrics; the sums here are over pairs and tokens, and the step
divides them by the pair and token counts of the whole step (all micro-batches and data-parallel ranks), which for one
batch is TRL's mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from xtl.errors import ConfigError

PairedLossType = Literal["sigmoid", "hinge", "ipo", "robust", "simpo", "orpo"]  # chosen/rejected pairs
UnpairedLossType = Literal["kto", "apo_zero_unpaired"]  # rows labeled desirable or not
LossType = Literal[PairedLossType, UnpairedLossType]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
REFERENCE_FREE: frozenset[str] = frozenset({"simpo", "orpo"})
UNPAIRED: frozenset[str] = frozenset(get_args(UnpairedLossType))
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
# what an unpaired objective sums per micro-batch (the means divide by the desirable and undesirable counts)
UNPAIRED_SUMS = (
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
    "count/chosen",
    "count/rejected",
    "kl",
)


@dataclass
class SequenceLogps:
    """Per-sequence log-probabilities of the responses of a batch of pairs (unpaired data: ``chosen`` is each row's
    own completion, ``rejected`` the mismatched one).

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
        metric_sums: Sums over pairs of each of :attr:`PreferenceLoss.metric_sums` (detached); the logged means
            are :meth:`PreferenceLoss.metric_means` of their totals.
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
            ``orpo`` (reference-free odds ratio plus the chosen responses' NLL); on unpaired data
            (``kind: unpaired_preference``): ``kto`` (each completion against the KL reference point, by its label)
            or ``apo_zero_unpaired`` (desirable completions up, undesirable down, no reference point).
        beta: Temperature of the implicit reward (IPO: the regularization tau; ORPO: the odds-ratio weight lambda).
        label_smoothing: Probability that a pair's preference is flipped (``sigmoid``/``simpo``: conservative DPO;
            ``robust``: the unbiased loss; in ``[0, 0.5)``).
        gamma: SimPO's target reward margin (TRL's ``simpo_gamma``).
        rpo_alpha: Weight of an NLL term on the chosen responses (RPO; TRL's ``sft`` loss, or CPO's ``cpo_alpha``
            with ``simpo``); ``None`` or 0: none. ORPO always has its NLL term with weight 1. Not with KTO.
        desirable_weight: KTO: weight of the desirable rows' losses (TRL's ``desirable_weight``).
        undesirable_weight: KTO: weight of the undesirable rows' losses; with unbalanced data, the KTO paper
            suggests ``desirable_weight * desirable rows / (undesirable_weight * undesirable rows)`` in ``[1, 4/3]``.
    """

    loss_type: LossType = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    rpo_alpha: float | None = None
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        key = "model.init_args.objective"
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"{key}.loss_type: {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        if not self.beta > 0:
            raise ConfigError(f"{key}.beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"{key}.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust", "simpo"):
            raise ConfigError(f"{key}.label_smoothing applies to sigmoid, robust and simpo, not {self.loss_type}")
        if self.unpaired and self.rpo_alpha:
            raise ConfigError(f"{key}.rpo_alpha applies to paired losses, not {self.loss_type}: remove it")
        for name in ("desirable_weight", "undesirable_weight"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{key}.{name} must be > 0, got {value}")
            if value != 1.0 and not self.unpaired:
                raise ConfigError(f"{key}.{name} applies to kto and apo_zero_unpaired, not {self.loss_type}")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model (the DPO family) or not (SimPO, ORPO)."""
        return self.loss_type not in REFERENCE_FREE

    @property
    def unpaired(self) -> bool:
        """Whether the loss trains on unpaired, labeled data (KTO) instead of chosen/rejected pairs."""
        return self.loss_type in UNPAIRED

    @property
    def metric_sums(self) -> tuple[str, ...]:
        """The per-batch sums behind the logged metrics (:meth:`metric_means`)."""
        return UNPAIRED_SUMS if self.unpaired else METRICS

    def metric_means(self, sums: dict[str, torch.Tensor], pairs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The logged metrics (TRL's names) from the totals of :attr:`metric_sums` over ``pairs`` pairs (rows).

        Paired losses: each sum over the pairs. Unpaired: ``rewards/chosen`` and ``logps/chosen`` over the desirable
        rows, ``.../rejected`` over the undesirable ones, ``rewards/margins`` their difference, ``kl`` over the rows.
        """
        if not self.unpaired:
            return {k: sums[k] / pairs.clamp(min=1) for k in METRICS}
        means = {}
        for side in ("chosen", "rejected"):
            count = sums[f"count/{side}"].clamp(min=1)
            means[f"rewards/{side}"] = sums[f"rewards/{side}"] / count
            means[f"logps/{side}"] = sums[f"logps/{side}"] / count
        means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
        means["kl"] = sums["kl"] / pairs.clamp(min=1)
        return means

    def kl_point(self, policy: SequenceLogps, reference: SequenceLogps) -> torch.Tensor:
        """KTO's reference point: the batch's estimate of the KL divergence between policy and reference, the mean
        over its mismatched completions of the policy's minus the reference's log-probability, clamped at 0 (as
        TRL; detached)."""
        diff = (_upcast(policy.rejected) - _upcast(reference.rejected)).detach()
        return diff.mean().clamp(min=0) if diff.numel() else diff.new_zeros(())

    @property
    def nll_weight(self) -> float:
        """Weight of the chosen responses' mean NLL in the loss."""
        return 1.0 if self.loss_type == "orpo" else float(self.rpo_alpha or 0.0)

    def terms(
        self,
        policy: SequenceLogps,
        reference: SequenceLogps | None,
        nll_sum: torch.Tensor,
        labels: torch.Tensor | None = None,
        kl: torch.Tensor | None = None,
    ) -> PairTerms:
        """The loss and metric sums of a batch of pairs.

        Args:
            policy: The policy's log-probabilities (with gradient).
            reference: The reference's (``None`` for SimPO and ORPO).
            nll_sum: Sum of the chosen response tokens' cross-entropy (with gradient).
            labels: Unpaired losses: each row's label (bool ``(P,)``, ``True``: desirable).
            kl: KTO: the KL reference point (a detached scalar, already averaged and clamped).
        """
        if self.needs_reference and reference is None:
            raise ValueError(f"loss_type {self.loss_type!r} needs reference log-probabilities")
        if self.unpaired:
            if labels is None:
                raise ValueError(f"loss_type {self.loss_type!r} needs each row's label")
            return self._unpaired_terms(policy, reference, nll_sum, labels, kl)
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

    def _unpaired_terms(
        self,
        policy: SequenceLogps,
        reference: SequenceLogps,
        nll_sum: torch.Tensor,
        labels: torch.Tensor,
        kl: torch.Tensor | None,
    ) -> PairTerms:
        """KTO (Eq. 7 of the KTO paper, as TRL) or unpaired APO-zero over each row's own completion."""
        chosen = _upcast(policy.chosen)
        ratio = chosen - _upcast(reference.chosen)
        desirable = labels.to(device=ratio.device, dtype=torch.bool)
        if self.loss_type == "kto":
            if kl is None:
                raise ValueError("loss_type 'kto' needs the KL estimate")
            kl = kl.to(ratio)
            good = 1 - torch.sigmoid(self.beta * (ratio - kl))
            bad = 1 - torch.sigmoid(self.beta * (kl - ratio))
        else:
            kl = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
            good, bad = 1 - torch.sigmoid(self.beta * ratio), torch.sigmoid(self.beta * ratio)
        losses = torch.where(desirable, self.desirable_weight * good, self.undesirable_weight * bad)
        rewards, logps = self.beta * ratio.detach(), chosen.detach()
        yes, no = desirable.to(ratio.dtype), (~desirable).to(ratio.dtype)
        metrics = {
            "rewards/chosen": (rewards * yes).sum(),
            "rewards/rejected": (rewards * no).sum(),
            "logps/chosen": (logps * yes).sum(),
            "logps/rejected": (logps * no).sum(),
            "count/chosen": yes.sum(),
            "count/rejected": no.sum(),
            "kl": kl.detach() * ratio.numel(),
        }
        return PairTerms(losses.sum(), nll_sum, metrics)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or in its own dtype when wider (fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2``."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


torch.serialization.add_safe_globals([PreferenceLoss])  # a hyperparameter in checkpoints (weights_only loads)
