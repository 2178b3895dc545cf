"""The RL losses against TRL's ``GRPOTrainer`` (the same log-probs, old log-probs, advantages and masks)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from xtl.errors import ConfigError
from xtl.rl.loss import (
    LOSS_TYPES,
    PolicyLossConfig,
    group_advantages,
    k3_kl,
    loss_normalizer,
    overlong_penalty,
    policy_loss,
)

B, T, MAX_LEN = 6, 7, 9
TOLERANCE = 1e-6


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    shift = torch.randn(B, 1, generator=g, dtype=torch.float64) * 0.4  # whole sequences off too (GSPO clips them)
    old = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 + shift  # ratios outside the clip range
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return {
        "logps": logps,
        "old": old,
        "ref": logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2,
        "advantages": torch.randn(B, generator=g, dtype=torch.float64),
        "mask": mask,
    }


def _trl_loss(batch: dict[str, torch.Tensor], loss_type: str, level: str, beta: float, eps: tuple) -> torch.Tensor:
    from trl import GRPOTrainer

    trainer = object.__new__(GRPOTrainer)
    logps = batch["logps"].clone().requires_grad_(True)
    trainer.__dict__.update(
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps[0],
        epsilon_high=eps[1],
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN,
        accelerator=SimpleNamespace(
            num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x
        ),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
    )
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": batch["mask"],
        "advantages": batch["advantages"],
        "old_per_token_logps": batch["old"],
        "ref_per_token_logps": batch["ref"],
        "num_items_in_batch": batch["mask"].sum(),
    }
    return trainer._compute_loss(None, inputs), logps


CASES = [
    ("grpo", "token"),
    ("bnpo", "token"),
    ("dr_grpo", "token"),
    ("dapo", "token"),
    ("grpo", "sequence"),  # GSPO
    ("dapo", "sequence"),
]


class TestTRLParity:
    @pytest.mark.parametrize("beta", [0.0, 0.04])
    @pytest.mark.parametrize(("loss_type", "level"), CASES)
    def test_loss_and_gradient_equal_trl(self, loss_type: str, level: str, beta: float) -> None:
        batch = _batch()
        eps = (0.2, 0.28)
        expected, trl_logps = _trl_loss(batch, loss_type, level, beta, eps)
        expected.backward()
        config = PolicyLossConfig(loss_type, level, epsilon_low=eps[0], epsilon_high=eps[1], beta=beta)
        logps = batch["logps"].clone().requires_grad_(True)
        out = policy_loss(logps, batch["old"], batch["advantages"], batch["mask"], config, batch["ref"], MAX_LEN)
        loss = out.loss_sum / out.num_items
        loss.backward()
        assert abs(loss.item() - expected.item()) <= TOLERANCE, (loss.item(), expected.item())
        assert torch.allclose(logps.grad, trl_logps.grad, atol=TOLERANCE, rtol=0)
        assert out.stats["clip_region"] > 0, "the batch exercises the clipping"

    def test_advantages_equal_trls_formula(self) -> None:
        from trl.trainer import utils as trl_utils

        rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0, 2.0])
        mean = rewards.view(-1, 3).mean(1).repeat_interleave(3)
        std = trl_utils.nanstd(rewards.view(-1, 3), dim=1).repeat_interleave(3)
        assert torch.allclose(group_advantages(rewards, 3), (rewards - mean) / (std + 1e-4))
        assert torch.equal(group_advantages(rewards, 3, "none"), rewards - mean)
        batch_std = trl_utils.nanstd(rewards)
        assert torch.allclose(group_advantages(rewards, 3, "batch"), (rewards - mean) / (batch_std + 1e-4))
        assert torch.equal(group_advantages(rewards, 3)[3:6], torch.zeros(3)), "an all-equal group gives no signal"


class TestPolicyLoss:
    def test_the_first_step_ratio_is_one_and_the_loss_is_minus_the_advantage(self) -> None:
        batch = _batch()
        out = policy_loss(batch["logps"], batch["logps"], batch["advantages"], batch["mask"], PolicyLossConfig())
        assert out.stats["clip_region"] == 0 and out.stats["ratio"] == out.stats["tokens"]
        assert torch.allclose(out.loss_sum, -batch["advantages"].sum())

    def test_gspo_clips_whole_sequences(self) -> None:
        batch = _batch()
        config = PolicyLossConfig(importance_sampling="sequence")
        out = policy_loss(batch["logps"], batch["old"], batch["advantages"], batch["mask"], config)
        per_seq_clip = out.stats["clip_region"]
        tokens = batch["mask"].sum(-1)
        assert per_seq_clip > 0
        assert any(float(per_seq_clip) == float(tokens[list(s)].sum()) for s in _subsets(B)), "whole sequences"

    def test_kl_is_zero_at_the_reference_and_positive_elsewhere(self) -> None:
        x = torch.randn(5, dtype=torch.float64)
        assert torch.equal(k3_kl(x, x), torch.zeros(5))
        assert (k3_kl(x, x + 0.3) > 0).all()

    def test_the_normalizer_of_each_loss_type(self) -> None:
        batch = _batch()
        tokens = batch["mask"].sum()
        want = {"grpo": B, "dr_grpo": B * MAX_LEN, "bnpo": tokens, "dapo": tokens}
        assert set(want) == set(LOSS_TYPES)
        for loss_type, count in want.items():
            out = policy_loss(
                batch["logps"], batch["old"], batch["advantages"], batch["mask"], PolicyLossConfig(loss_type),
                max_completion_length=MAX_LEN,
            )  # fmt: skip
            assert out.num_items == count == loss_normalizer(loss_type, B, tokens, MAX_LEN), loss_type

    def test_refusals(self) -> None:
        with pytest.raises(ConfigError, match="objective.loss_type must be one of grpo, bnpo, dr_grpo, dapo"):
            PolicyLossConfig(loss_type="ppo")
        with pytest.raises(ConfigError, match="objective.importance_sampling"):
            PolicyLossConfig(importance_sampling="seq")
        with pytest.raises(ConfigError, match="objective.scale_rewards must be one of group, batch, none"):
            PolicyLossConfig(scale_rewards="std")
        batch = _batch()
        with pytest.raises(ValueError, match="ref_logps"):
            policy_loss(batch["logps"], batch["old"], batch["advantages"], batch["mask"], PolicyLossConfig(beta=0.1))
        with pytest.raises(ValueError, match="max_completion_length"):
            config = PolicyLossConfig(loss_type="dr_grpo")
            policy_loss(batch["logps"], batch["old"], batch["advantages"], batch["mask"], config)


class TestOverlongPenalty:
    def test_zero_then_a_linear_ramp_to_minus_the_factor(self) -> None:
        lengths = torch.tensor([2, 6, 7, 8, 10, 12])
        penalty = overlong_penalty(lengths, max_new_tokens=10, buffer=4, factor=0.5)
        assert penalty.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
        with pytest.raises(ValueError, match="buffer"):
            overlong_penalty(lengths, 10, 0)


def _subsets(n: int) -> list[tuple[int, ...]]:
    from itertools import combinations

    return [c for k in range(1, n + 1) for c in combinations(range(n), k)]


class TestAdvantagesWithoutRewards:
    def test_a_failed_sample_is_left_out_of_its_groups_statistics(self) -> None:
        rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0, 1.0, 0.0])
        advantages = group_advantages(rewards, 3)
        assert advantages[1].isnan() and not advantages[[0, 2, 3, 4, 5]].isnan().any()
        assert torch.allclose(advantages[[0, 2]], group_advantages(torch.tensor([1.0, 0.0]), 2))
