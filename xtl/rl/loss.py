"""Policy-gradient losses of group-relative RL: GRPO, BNPO, Dr.GRPO, DAPO and GSPO (TRL's formulas).

Every function works on padded ``(B, T)`` completion tensors: the per-token log-probabilities of the policy being
trained (``logps``), of the policy that sampled the completions (``old_logps``) and, for the KL term, of the
reference (``ref_logps``); ``mask`` is 1 on the completion tokens. :func:`policy_loss` returns a *sum* and the count
it is normalized by, so that a step split over micro-batches and ranks divides once, by the step's total
(:func:`xtl.train.step.forward_backward`):

=========  ======================================================  =================================
loss_type  per batch                                               normalized by
=========  ======================================================  =================================
grpo       sum over sequences of the token mean of the sequence     sequences
bnpo       sum over tokens                                          completion tokens
dr_grpo    sum over tokens                                          sequences x ``max_completion_length``
dapo       sum over tokens                                          completion tokens of the whole step
=========  ======================================================  =================================

(``bnpo`` and ``dapo`` differ in TRL only in how gradient accumulation rescales them; here both divide by the
step's tokens.) :func:`loss_normalizer` is the one place that says what each loss type divides by. The importance
ratio is per token, or per sequence (GSPO: the exponent of the mean log-ratio of the sequence,
``importance_sampling: sequence``), clipped to ``[1 - epsilon_low, 1 + epsilon_high]`` (DAPO's clip-higher sets
``epsilon_high`` above ``epsilon_low``). With ``beta > 0`` the k3 estimator of the KL divergence to the reference is
added per token (TRL's with ``use_bias_correction_kl=False``: the KL term is not weighted by the importance ratio).

:func:`policy_metrics` turns the step's summed statistics into the logged means, under TRL's names
(``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``kl``, ``entropy``) and ``ratio``
(xtl's: the mean importance ratio).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from xtl.errors import ConfigError

KEY = "model.init_args.objective"
LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ImportanceLevel = Literal["token", "sequence"]
RewardScaling = Literal["group", "batch", "none"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
IMPORTANCE_LEVELS: tuple[str, ...] = get_args(ImportanceLevel)
REWARD_SCALINGS: tuple[str, ...] = get_args(RewardScaling)
STD_EPS = 1e-4  # added to the reward std before dividing (TRL's constant)
# logged name (TRL's where TRL logs the same quantity) -> (summed statistic, the count it is averaged over)
POLICY_METRICS: dict[str, tuple[str, str]] = {
    "clip_ratio/low_mean": ("clip_low", "clip_items"),
    "clip_ratio/high_mean": ("clip_high", "clip_items"),
    "clip_ratio/region_mean": ("clip_region", "clip_items"),
    "ratio": ("ratio", "tokens"),
    "kl": ("kl", "tokens"),
    "entropy": ("entropy", "tokens"),
}
# every statistic of PolicyLoss.stats, in a fixed order (summed over micro-batches and ranks as one tensor)
POLICY_STATS: tuple[str, ...] = tuple(dict.fromkeys(name for pair in POLICY_METRICS.values() for name in pair))


@dataclass
class PolicyLossConfig:
    """The policy objective.

    Args:
        loss_type: ``grpo`` (token mean per sequence, averaged over sequences), ``bnpo`` (token mean over the batch),
            ``dr_grpo`` (token sum over sequences x ``max_new_tokens``: no length bias), ``dapo`` (token mean over
            the whole step).
        importance_sampling: ``token`` (PPO's per-token ratio) or ``sequence`` (GSPO: one ratio per sequence, the
            exponent of its mean log-ratio).
        epsilon_low: The ratio is clipped below at ``1 - epsilon_low``.
        epsilon_high: The ratio is clipped above at ``1 + epsilon_high`` (``None``: ``epsilon_low``; DAPO's
            clip-higher uses 0.28 with 0.2).
        beta: Weight of the k3 KL estimate to the reference per token (0: no reference is needed).
        scale_rewards: Advantages are the reward minus its group mean, divided by the reward std of the ``group``,
            of the ``batch``, or not at all (``none``: Dr.GRPO).

    Raises:
        ConfigError: Naming the first setting out of range.

    Warns:
        UserWarning: Sequence-level importance sampling with a loss type that sums tokens (as TRL warns).
    """

    loss_type: LossType = "grpo"
    importance_sampling: ImportanceLevel = "token"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    scale_rewards: RewardScaling = "group"

    def __post_init__(self) -> None:
        for name, allowed in (
            ("loss_type", LOSS_TYPES),
            ("importance_sampling", IMPORTANCE_LEVELS),
            ("scale_rewards", REWARD_SCALINGS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{KEY}.{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon_low
        if not 0 <= self.epsilon_low < 1 or self.epsilon_high < 0:
            raise ConfigError(
                f"{KEY}.epsilon_low must be in [0, 1) and epsilon_high >= 0, got {self.epsilon_low}, "
                f"{self.epsilon_high}"
            )
        if self.beta < 0:
            raise ConfigError(f"{KEY}.beta must be >= 0, got {self.beta}")
        if self.importance_sampling == "sequence" and self.loss_type != "grpo":  # TRL's warning
            warnings.warn(
                f"{KEY}: with importance_sampling: sequence, the {self.loss_type!r} loss sums per-token "
                "contributions, which weights each sequence by its completion length instead of optimizing the "
                "per-sequence objective; GSPO's setup is loss_type: grpo",
                UserWarning,
                stacklevel=3,
            )


torch.serialization.add_safe_globals([PolicyLossConfig])  # a hyperparameter in checkpoints (weights_only loads)


@dataclass
class PolicyLoss:
    """What :func:`policy_loss` returns for one batch.

    Attributes:
        loss_sum: The loss summed as the loss type says (divide by the step's ``num_items``).
        num_items: This batch's share of the normalizer (:func:`loss_normalizer`).
        stats: Sums for the step's metrics (every name of :data:`POLICY_STATS`; :func:`policy_metrics` turns their
            totals into means): ``tokens``; ``clip_items`` (tokens, or sequences under ``sequence`` importance: what
            the clipping statistics count), ``clip_low``, ``clip_high``, ``clip_region`` (clipped tokens, or clipped
            sequences); ``ratio`` (the importance ratio over tokens); ``kl`` (k3, over tokens; 0 without a KL term);
            ``entropy`` (over tokens; 0 unless given).
    """

    loss_sum: torch.Tensor
    num_items: torch.Tensor
    stats: dict[str, torch.Tensor]


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """Group-relative advantages of ``rewards`` ``(N * group_size,)``, groups contiguous, ``NaN`` for samples
    without a reward (their advantage is ``NaN``: they do not train; the others' statistics leave them out).

    ``reward - mean(group)``, divided by ``std + 1e-4`` (unbiased std of the group, or of the whole batch; not at
    all for ``scale="none"``), as TRL's ``GRPOTrainer`` computes them (``nanmean``, ``nanstd``).
    """
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - grouped.nanmean(dim=1, keepdim=True)).reshape(-1)
    if scale == "group":
        advantages = advantages / (_nanstd(grouped, dim=1).repeat_interleave(group_size) + STD_EPS)
    elif scale == "batch":
        advantages = advantages / (_nanstd(rewards.reshape(1, -1), dim=1) + STD_EPS)
    elif scale != "none":
        raise ValueError(f"scale must be one of {', '.join(REWARD_SCALINGS)}, got {scale!r}")
    return advantages


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to ``max_new_tokens - buffer`` tokens, then falling linearly to
    ``-factor`` at ``max_new_tokens`` (and ``-factor`` beyond)."""
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"the overlong buffer must be in (0, max_new_tokens={max_new_tokens}], got {buffer}")
    free = max_new_tokens - buffer
    lengths = lengths.to(torch.float64)
    ramp = (free - lengths) / buffer * factor
    return torch.where(lengths <= free, torch.zeros_like(ramp), ramp.clamp(min=-factor))


def loss_normalizer(
    loss_type: str, sequences: int, tokens: float | torch.Tensor, max_completion_length: int | None = None
) -> float | torch.Tensor:
    """What a batch of ``sequences`` completions with ``tokens`` completion tokens adds to the step's normalizer.

    The one place that says it (module docstring's table): ``grpo`` divides by sequences, ``dr_grpo`` by sequences x
    ``max_completion_length``, ``bnpo`` and ``dapo`` by completion tokens (``tokens`` itself is returned, a tensor
    stays a tensor).

    Raises:
        ValueError: ``dr_grpo`` without ``max_completion_length``; an unknown loss type.
    """
    if loss_type == "grpo":
        return float(sequences)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo needs max_completion_length (the sampling's max_new_tokens)")
        return float(sequences * max_completion_length)
    if loss_type in ("bnpo", "dapo"):
        return tokens
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def policy_metrics(totals: dict[str, torch.Tensor], config: PolicyLossConfig) -> dict[str, torch.Tensor]:
    """The logged means (:data:`POLICY_METRICS`, TRL's names) of a step's ``stats`` summed over its micro-batches
    and ranks; ``kl`` only with a KL term (``beta > 0``), as TRL logs it."""
    return {
        name: totals[value] / totals[count].clamp(min=1)
        for name, (value, count) in POLICY_METRICS.items()
        if name != "kl" or config.beta
    }


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of ``KL(policy || reference)`` per token: ``exp(r - p) - (r - p) - 1``."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
    ref_logps: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    token_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> PolicyLoss:
    """The clipped policy-gradient loss of one batch of completions.

    Args:
        logps: ``(B, T)`` log-probabilities of the completion tokens under the policy being trained.
        old_logps: ``(B, T)`` the same under the policy that sampled them (no gradient).
        advantages: ``(B,)`` one advantage per completion.
        mask: ``(B, T)`` 1 on completion tokens, 0 on padding.
        config: The objective.
        ref_logps: ``(B, T)`` the reference's log-probabilities (needed when ``config.beta > 0``).
        max_completion_length: The constant length of ``dr_grpo``'s normalizer.
        token_weights: ``(B, T)`` weights of the policy term per token (the truncated importance-sampling correction
            of an engine whose numerics differ from the trainer's), applied before the KL term as TRL does.
        entropy: ``(B, T)`` the policy's entropy per token (only summed for the metrics).

    Returns:
        PolicyLoss: The summed loss, its normalizer and metric sums.

    Raises:
        ValueError: ``beta > 0`` without ``ref_logps``; ``dr_grpo`` without ``max_completion_length``.
    """
    mask = mask.to(logps.dtype)
    tokens = mask.sum(-1)
    log_ratio = logps - old_logps
    if config.importance_sampling == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / tokens.clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logps.dtype).unsqueeze(-1)
    clipped = torch.clamp(ratio, 1 - config.epsilon_low, 1 + config.epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if token_weights is not None:
        per_token = per_token * token_weights
    zero = torch.zeros((), dtype=logps.dtype, device=logps.device)
    stats: dict[str, torch.Tensor] = {"kl": zero, "entropy": zero}
    if config.beta:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities (ref_logps)")
        kl = k3_kl(logps, ref_logps)
        per_token = per_token + config.beta * kl
        stats["kl"] = (kl * mask).sum().detach()
    if entropy is not None:
        stats["entropy"] = (entropy.detach() * mask).sum()
    per_token = per_token.expand_as(logps) * mask
    if config.loss_type == "grpo":
        loss_sum = (per_token.sum(-1) / tokens.clamp(min=1.0)).sum()
    else:  # bnpo, dapo, dr_grpo: over tokens
        loss_sum = per_token.sum()
    normalizer = loss_normalizer(config.loss_type, logps.shape[0], tokens.sum().detach(), max_completion_length)
    num_items = torch.as_tensor(normalizer, dtype=logps.dtype, device=logps.device)
    # clipped where the clipped ratio is the one taken (TRL's statistics): per token, or per sequence (GSPO)
    items = (tokens > 0).to(mask.dtype).unsqueeze(-1) if config.importance_sampling == "sequence" else mask
    low = ((ratio < 1 - config.epsilon_low) & (adv < 0)).to(mask.dtype) * items
    high = ((ratio > 1 + config.epsilon_high) & (adv > 0)).to(mask.dtype) * items
    stats.update(
        tokens=tokens.sum().detach(),
        clip_items=items.sum().detach(),
        clip_low=low.sum().detach(),
        clip_high=high.sum().detach(),
        clip_region=(low + high).sum().detach(),
        ratio=(ratio.detach().expand_as(mask) * mask).sum(),
    )
    return PolicyLoss(loss_sum, num_items, stats)


def _nanstd(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased standard deviation over ``dim`` ignoring ``NaN`` (``NaN`` with fewer than two values)."""
    count = (~values.isnan()).sum(dim)
    variance = ((values - values.nanmean(dim, keepdim=True)) ** 2).nansum(dim) / (count - 1).clamp(min=0)
    return variance.sqrt()
