"""Online DPO: :class:`OnlineDPOModule` trains on pairs sampled from the current policy, as TRL's
``OnlineDPOTrainer``.

Each prompt gets two completions from the rollout engine (``sampling.group_size: 2``), judged by the run's judger (a
rule, a reward model, several routed by data source). :func:`rank_pairs` makes a pair of each prompt's two with TRL's
rule: a completion that did not finish with a stop token (no EOS: cut at ``sampling.max_new_tokens``) loses
``objective.missing_eos_penalty`` of its reward, the first completion is chosen when its reward is at least the
second's (a tie chooses the first) and rejected otherwise. A prompt whose judging failed for either completion has no
pair: it is dropped and counted (``rollout/dropped_pairs``; TRL, whose reward functions return ``None`` there, sums
the missing reward as 0 and trains the pair anyway).

The loss is TRL's on each pair's summed completion log-probabilities of the policy and of the reference (computed
once, when the batch is produced): ``logits = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)``, ``sigmoid``
``-log sigmoid(beta * logits)`` or ``ipo`` ``(logits - 1 / (2 beta))**2``, through
:class:`~xtl.train.preference_loss.PreferenceLoss` (offline DPO's formulas; its IPO divides each response's
log-probability by its length, as TRL's ``DPOTrainer`` does, TRL's online DPO does not: every response is passed
with a length of 1). Log-probabilities are scored at temperature 1, whatever the sampling temperature (as TRL's).
A step's loss is the sum over its pairs divided by the pairs of the whole step (every micro-batch and data-parallel
rank): for one rollout batch on one device, TRL's mean.

What the module inherits from :class:`~xtl.rl.GRPOModule`: the rollout engines, dynamic sampling (which drops the
pairs whose rewards tie), the replay buffer, asynchronous production, checkpoints of pending updates, the held-out
evaluation (greedy, judged). One rollout batch is one optimizer step by default (TRL's), ``updates.mini_batches``
and ``updates.epochs`` cut it into more.

The step logs TRL's metrics under ``train/``: ``rewards/{chosen,rejected,margins,accuracies}``,
``logps/{chosen,rejected}``, ``objective/{kl,entropy,non_score_reward,rlhf_reward,scores,scores_margin}``,
``contain_eos_token`` (TRL's ``val/contain_eos_token``) and ``beta``; the ``objective/scores*`` and
``contain_eos_token`` are the rollout batch's (the step's with one update per batch). ``objective/kl`` and
``objective/entropy`` sum each completion's tokens only (TRL 1.16 also sums the padding after a completion's EOS).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch

from xtl.errors import ConfigError
from xtl.model import ModelOutput
from xtl.rl.agent.loop import AgentLoop, SingleTurnLoop
from xtl.rl.buffer import Group, ProduceStats, Sample, SampleState
from xtl.rl.engines import EngineSettings
from xtl.rl.judger import BaseJudger
from xtl.rl.module import GRPOModule
from xtl.rl.packing import RLMicroBatch, pack_sequences, sample_images, split_round_robin
from xtl.rl.rollout import SamplingSettings
from xtl.rl.settings import RolloutSettings, UpdateSettings
from xtl.rl.vision import PromptImages, PromptVision
from xtl.train.preference_loss import METRICS, PreferenceLoss, SequenceLogps
from xtl.train.reference import ReferenceConfig, ReferenceMode

KEY = "model.init_args"
OnlineLossType = Literal["sigmoid", "ipo"]
ONLINE_LOSS_TYPES: tuple[str, ...] = get_args(OnlineLossType)
PAIR_METRICS = METRICS  # offline DPO's, TRL's names
# what a micro-batch sums for the step's metrics (one tensor over micro-batches and ranks, in this order)
STEP_SUMS = ("pairs", *PAIR_METRICS, "kl", "entropy")


@dataclass
class OnlineDPOLoss:
    """The online DPO objective (``model.init_args.objective``), TRL's ``OnlineDPOConfig`` fields of the same names.

    Args:
        beta: Temperature of the implicit reward (IPO: the regularization tau); one value for the whole run (TRL
            also takes one per epoch).
        loss_type: ``sigmoid`` (DPO) or ``ipo`` (not length-normalized, as TRL's online DPO).
        missing_eos_penalty: Subtracted from the reward of a completion that did not end with a stop token
            (``None``: no penalty).

    Raises:
        ConfigError: Naming the first setting out of range.
    """

    beta: float = 0.1
    loss_type: OnlineLossType = "sigmoid"
    missing_eos_penalty: float | None = None

    def __post_init__(self) -> None:
        key = f"{KEY}.objective"
        if self.loss_type not in ONLINE_LOSS_TYPES:
            raise ConfigError(f"{key}.loss_type must be one of {', '.join(ONLINE_LOSS_TYPES)}, got {self.loss_type!r}")
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float) or not self.beta > 0:
            raise ConfigError(f"{key}.beta must be one number > 0 (not a list per epoch), got {self.beta!r}")
        if self.missing_eos_penalty is not None and not self.missing_eos_penalty >= 0:
            raise ConfigError(f"{key}.missing_eos_penalty must be >= 0 (or null), got {self.missing_eos_penalty}")

    @property
    def pair_loss(self) -> PreferenceLoss:
        """The pair loss (offline DPO's formulas; see the module docstring for IPO's lengths)."""
        return PreferenceLoss(loss_type=self.loss_type, beta=self.beta)


torch.serialization.add_safe_globals([OnlineDPOLoss])  # a hyperparameter in checkpoints (weights_only loads)


@dataclass
class Pair:
    """A prompt's two completions, ranked.

    Attributes:
        chosen: The completion with the higher score (the first one on a tie).
        rejected: The other.
        chosen_score: The chosen completion's reward, less the missing-EOS penalty.
        rejected_score: The rejected one's.
    """

    chosen: Sample
    rejected: Sample
    chosen_score: float
    rejected_score: float


def rank_pairs(groups: list[Group], missing_eos_penalty: float | None = None) -> tuple[list[Pair], int]:
    """The pairs of ``groups`` (two completions each) by TRL's rule (module docstring), and how many groups had
    none (a completion without a judged reward).

    Raises:
        ValueError: A group without exactly two completions.
    """
    pairs, dropped = [], 0
    for group in groups:
        if len(group.samples) != 2:
            raise ValueError(f"online DPO pairs two completions per prompt, got {len(group.samples)}")
        first, second = group.samples
        if any(s.state != SampleState.COMPLETED or s.reward is None for s in group.samples):
            dropped += 1
            continue
        scores = [_score(first, missing_eos_penalty), _score(second, missing_eos_penalty)]
        if scores[0] >= scores[1]:
            pairs.append(Pair(first, second, scores[0], scores[1]))
        else:
            pairs.append(Pair(second, first, scores[1], scores[0]))
    return pairs, dropped


def pair_micro_batches(
    pairs: list[Pair],
    parts: int,
    vision: PromptVision | None = None,
    filler: tuple[list[int], PromptImages] | None = None,
) -> list[RLMicroBatch]:
    """``parts`` packed micro-batches of one update's pairs, dealt round-robin (an empty one is a filler): the
    sequences of each are the pairs' chosen and rejected completions, alternating (with their prompt's images,
    processed by ``vision``; ``filler``: a sharded vision-language policy's image filler of a micro-batch without
    images), and its ``num_items`` its pairs."""
    out = []
    for part in split_round_robin(pairs, parts):
        samples = [s for pair in part for s in (pair.chosen, pair.rejected)]
        sequences = [(s.prompt_ids, s.response_ids) for s in samples]
        images = sample_images(samples, vision)
        mb = pack_sequences(sequences, [0.0] * len(sequences), images=images, filler=filler)  # no advantages
        mb.num_items = float(len(part))
        out.append(mb)
    return out


class OnlineDPOModule(GRPOModule):
    """Online DPO of any family: two completions per prompt from the current policy, ranked by the judger,
    trained with the DPO loss against a reference (:mod:`xtl.rl.online_dpo`).

    Args:
        model: The policy: HF directory, alias or config mapping (as :class:`~xtl.train.LanguageModule`).
        judger: Scores completions (default :class:`~xtl.rl.MathJudger`; a reward model through a judger that runs
            one); a ``class_path`` in YAML.
        sampling: How the two completions are sampled (``group_size`` must be 2).
        objective: ``beta``, ``loss_type`` (``sigmoid``, ``ipo``) and ``missing_eos_penalty``.
        rollout: How each rollout batch is produced (prompts per rank, dynamic sampling, staleness, ...).
        updates: Optimizer steps per rollout batch (``mini_batches``, ``epochs``; default one, as TRL) and
            micro-batches per step.
        engine: The rollout engine (``local``, ``vllm``, ``ray``) and its settings.
        reference: The reference (:class:`~xtl.train.reference.ReferenceConfig` or a mode name): ``auto``
            (``adapters_off`` under fresh LoRA adapters, else ``live``), ``live`` (the starting policy, frozen; under
            LoRA its starting adapters), ``adapters_off`` or ``model``; not ``none`` or ``precomputed``.
        eval_max_new_tokens: Greedy decoding budget of the held-out evaluation (default ``sampling.max_new_tokens``).
        agent: Only the single-turn loop (``None``): the pairs compare two single-turn completions.
        **kwargs: :class:`~xtl.train.LanguageModule`'s settings (optimizer, schedule, clipping, ...).

    Raises:
        ConfigError: A group size other than 2, an agent loop, routing replay, more mini-batches than pairs, a
            reference the objective cannot use, settings out of range.
    """

    objective = "online DPO"

    def __init__(
        self,
        model: str | dict[str, Any],
        judger: BaseJudger | None = None,
        sampling: SamplingSettings = SamplingSettings(group_size=2),
        objective: OnlineDPOLoss = OnlineDPOLoss(),
        rollout: RolloutSettings = RolloutSettings(),
        updates: UpdateSettings = UpdateSettings(),
        engine: EngineSettings = EngineSettings(),
        reference: ReferenceMode | ReferenceConfig = "auto",
        eval_max_new_tokens: int | None = None,
        agent: AgentLoop | None = None,
        **kwargs: Any,
    ) -> None:
        if sampling.group_size != 2:
            raise ConfigError(
                f"{KEY}.sampling.group_size must be 2 for online DPO (a pair per prompt), got {sampling.group_size}"
            )
        if agent is not None and not isinstance(agent, SingleTurnLoop):
            raise ConfigError(
                f"{KEY}.agent: online DPO pairs two single-turn completions; {type(agent).__name__} is not supported, "
                "remove it"
            )
        if kwargs.get("routing_replay"):
            raise ConfigError(f"{KEY}.routing_replay keeps an importance ratio exact; online DPO has none: remove it")
        if updates.mini_batches > rollout.prompts_per_step:
            raise ConfigError(
                f"{KEY}.updates.mini_batches ({updates.mini_batches}) exceeds the pairs of a rollout batch "
                f"(rollout.prompts_per_step = {rollout.prompts_per_step})"
            )
        super().__init__(
            model, judger=judger, sampling=sampling, objective=objective, rollout=rollout, updates=updates,
            engine=engine, reference=reference, eval_max_new_tokens=eval_max_new_tokens, agent=agent, **kwargs,
        )  # fmt: skip
        self.pair_loss = objective.pair_loss

    # ---- training --------------------------------------------------------------------------------------------

    @property
    def scoring_temperature(self) -> float:
        """Online DPO scores log-probabilities at temperature 1 (TRL's), whatever the sampling temperature."""
        return 1.0

    def describe_objective(self) -> str:
        """The objective and its reference, for the log line of the fit's start."""
        objective = self.objective
        penalty = objective.missing_eos_penalty
        return (
            f"online DPO, {objective.loss_type} (beta {objective.beta}"
            + (f", missing-EOS penalty {penalty:g}" if penalty is not None else "")
            + f", reference {self.reference.mode}: {self.reference.describe()})"
        )

    def build_updates(self, groups: list[Group], stats: ProduceStats) -> list[list[RLMicroBatch]]:
        """The rollout batch's pairs (:func:`rank_pairs`), cut into the pending updates with the reference's
        log-probabilities, and the batch's metrics."""
        pairs, dropped = rank_pairs(groups, self.objective.missing_eos_penalty)
        samples = [s for pair in pairs for s in (pair.chosen, pair.rejected)]
        metrics = self._metrics(stats, groups, samples)
        metrics.update(_pair_metrics(pairs))
        metrics["rollout/dropped_pairs"] = float(dropped)
        self._rollout_metrics = metrics
        updates = [
            pair_micro_batches(chunk, self.updates.micro_batches, self._vision, self._image_filler())
            for chunk in split_round_robin(pairs, self.updates.mini_batches)
        ]
        with torch.no_grad():
            for update in updates:
                for mb in update:
                    self._fill_logps(mb, policy=False)  # the reference's, once
        return [list(update) for _ in range(self.updates.epochs) for update in updates]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """One optimizer step on the next pending update's pairs (producing a rollout batch first when none is
        left)."""
        if not self._pending:
            self._produce()
        update = [self._on_device(mb) for mb in self._pending.pop(0)]
        forward, sums = self.step_objective()
        result = self.optimizer_step_over(update, forward, lambda mb: mb.num_items)
        values = {f"train/{name}": value for name, value in self.step_metrics(sums).items()}
        values.update({k: torch.tensor(v) for k, v in self._rollout_metrics.items()})
        self.log_step_metrics(values)
        return result.loss_sum / result.global_tokens.clamp(min=1)

    def step_objective(self) -> tuple[Callable[[RLMicroBatch], ModelOutput], list[dict[str, torch.Tensor]]]:
        """The pair loss of one update: a micro-batch's forward, whose ``loss_sum`` (summed over its pairs) the step
        divides by the update's pairs (over micro-batches and data-parallel ranks), and the list its metric sums
        (:data:`STEP_SUMS`) are appended to."""
        sums: list[dict[str, torch.Tensor]] = []

        def forward(mb: RLMicroBatch) -> ModelOutput:
            if mb.ref_logps is None:
                raise RuntimeError("online DPO needs the reference's log-probabilities, computed at production")
            policy = self._token_logps(self.model, mb)[0].sum(-1)  # (2P,): chosen, rejected alternating
            reference = mb.ref_logps.to(policy).sum(-1)
            ones = torch.ones_like(policy[0::2])  # TRL's online IPO is not length-normalized (module docstring)
            terms = self.pair_loss.terms(
                SequenceLogps(policy[0::2], policy[1::2], ones, ones),
                SequenceLogps(reference[0::2], reference[1::2], ones, ones),
                policy.new_zeros(()),
            )
            kl = (policy.detach() - reference).sum()
            sums.append({
                "pairs": torch.tensor(mb.num_items, dtype=torch.float64, device=policy.device),
                **{k: terms.metric_sums[k].double() for k in PAIR_METRICS},
                "kl": kl.double(), "entropy": -policy.detach().sum().double(),
            })  # fmt: skip
            return ModelOutput(loss_sum=terms.loss_sum, num_tokens=None)

        return forward, sums

    def step_metrics(self, sums: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The step's metrics (TRL's names, without ``train/``) from its micro-batches' sums, summed over the
        data-parallel ranks: the pair means, ``objective/kl`` and ``objective/entropy`` per completion, the KL's
        ``objective/non_score_reward`` (``-beta kl``) and, with the rollout batch's ``objective/scores``,
        ``objective/rlhf_reward``."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        totals = self._sum_over_data_ranks(torch.stack([sum((s[k] for s in sums), zero) for k in STEP_SUMS]))
        total = dict(zip(STEP_SUMS, totals))
        pairs = total["pairs"].clamp(min=1)
        out = {name: total[name] / pairs for name in PAIR_METRICS}
        kl = total["kl"] / (2 * pairs)
        non_score = -self.objective.beta * kl
        scores = self._rollout_metrics.get("train/objective/scores", 0.0)
        out.update({
            "objective/kl": kl, "objective/entropy": total["entropy"] / (2 * pairs),
            "objective/non_score_reward": non_score, "objective/rlhf_reward": non_score + scores,
            "beta": torch.tensor(self.objective.beta, dtype=torch.float64),
        })  # fmt: skip
        return out


# ---- private ---------------------------------------------------------------------------------------------------


def _score(sample: Sample, missing_eos_penalty: float | None) -> float:
    """The sample's reward, less the penalty when it did not finish with a stop token."""
    penalty = missing_eos_penalty if missing_eos_penalty is not None and sample.finish_reason != "stop" else 0.0
    return float(sample.reward) - penalty


def _pair_metrics(pairs: list[Pair]) -> dict[str, float]:
    """The rollout batch's scores (TRL's ``objective/scores``, ``objective/scores_margin``) and the share of its
    completions that ended with a stop token (``contain_eos_token``)."""
    if not pairs:
        return {"train/objective/scores": 0.0, "train/objective/scores_margin": 0.0, "train/contain_eos_token": 0.0,
                "train/pairs": 0.0}  # fmt: skip
    scores = [score for p in pairs for score in (p.chosen_score, p.rejected_score)]
    eos = [s.finish_reason == "stop" for p in pairs for s in (p.chosen, p.rejected)]
    return {
        "train/objective/scores": float(np.mean(scores)),
        "train/objective/scores_margin": float(np.mean([p.chosen_score - p.rejected_score for p in pairs])),
        "train/contain_eos_token": float(np.mean(eos)),
        "train/pairs": float(len(pairs)),
    }
