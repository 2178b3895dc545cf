"""The RL losses against TRL's ``GRPOTrainer`` (the same log-probs, old log-probs, advantages and masks), and the
loss's own statistics.

TRL's side is its public API: a ``GRPOTrainer`` built from a ``GRPOConfig`` (on a tiny Qwen3 saved by
transformers), its ``compute_loss(model, inputs)`` and the metrics it logs (``Trainer.log``, ``state.log_history``).
``GRPOTrainer`` has no entry that takes log-probabilities, so the ``model`` handed to ``compute_loss`` is a stand-in
that returns the batch's fp64 log-probabilities and entropies as TRL's fused LM head does (``log_probs``,
``entropy``). The KL term equals TRL's with ``use_bias_correction_kl=False`` (TRL's default weights the KL by the
importance ratio; pinned by :meth:`TestTRLParity.test_trls_default_kl_is_weighted_by_the_ratio`).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import nanstd

from xtl.errors import ConfigError
from xtl.rl.loss import (
    LOSS_TYPES,
    POLICY_STATS,
    PolicyLossConfig,
    group_advantages,
    k3_kl,
    loss_normalizer,
    overlong_penalty,
    policy_loss,
    policy_metrics,
)
from xtl.utils import resolve_pretrained

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning")

B, T, MAX_LEN = 6, 7, 9
PROMPT = 2  # prompt tokens of each sequence (TRL scores the completion's only)
TOLERANCE = 1e-6
# TRL's logged metrics that xtl logs under the same name (the clip statistics are fp32 in TRL)
SHARED_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl", "entropy")


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # whole sequences off too, some where the clipping binds (GSPO clips them): ratios above 1 + epsilon_high with a
    # positive advantage, below 1 - epsilon_low with a negative one, and the reverse (not clipped)
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    shift = torch.tensor([-0.4, 0.4, 0.0, 0.0, -0.4, 0.4], dtype=torch.float64).unsqueeze(-1)
    old = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 + shift  # ratios outside the clip range
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    # ratios of 1.25 with positive advantages: above 1 + epsilon_low, inside DAPO's clip-higher bound 1 + 0.28 (a
    # token of sequence 0, and sequence 2's sequence-level ratio)
    old[0, 0] = logps[0, 0] - torch.tensor(1.25, dtype=torch.float64).log()
    centred = old[2, :5] - logps[2, :5] - (old[2, :5] - logps[2, :5]).mean()
    old[2, :5] = logps[2, :5] + centred - torch.tensor(1.25, dtype=torch.float64).log()
    return {
        "logps": logps,
        "old": old,
        "ref": logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2,
        "advantages": sign * (torch.rand(B, generator=g, dtype=torch.float64) + 0.1),
        "entropy": torch.rand(B, T, generator=g, dtype=torch.float64) * 2,
        "mask": mask,
    }


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 saved by transformers: what ``GRPOTrainer`` is built on (and its reference, with a KL term)."""
    path = tmp_path_factory.mktemp("grpo_trl") / "policy"
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=1600, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)


class FusedHeadStandIn(torch.nn.Module):
    """Answers ``GRPOTrainer``'s scoring call (``model(input_ids, attention_mask, labels, fused_lm_head=True)``) with
    fixed per-token log-probabilities and entropies of the completion tokens, as TRL's fused LM head returns them."""

    def __init__(self, logps: torch.Tensor, entropy: torch.Tensor) -> None:
        super().__init__()
        self.logps, self.entropy = logps, entropy

    def forward(self, input_ids, attention_mask, labels=None, fused_lm_head=False, **kwargs):  # noqa: ANN001, ANN201
        assert fused_lm_head and input_ids.shape == (B, PROMPT + T)
        prompt = torch.zeros(B, PROMPT, dtype=self.logps.dtype)
        return SimpleNamespace(
            log_probs=torch.cat([prompt, self.logps], 1), entropy=torch.cat([prompt, self.entropy], 1)
        )


def _trl_loss(
    policy: Path, tmp_path: Path, batch: dict[str, torch.Tensor], **config
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """TRL's loss of ``batch``, the gradient of its log-probabilities and TRL's logged metrics (its eval mode: no
    gradient-accumulation scaling)."""
    args = GRPOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, fp16=False, max_completion_length=MAX_LEN,
        num_generations=2, per_device_train_batch_size=2, save_strategy="no", logging_strategy="no",
        disable_tqdm=True, **config,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained("tiny:", "tokenizer"))
    trainer = GRPOTrainer(
        model=str(policy),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]),
        processing_class=tokenizer,
    )
    trainer.model.eval()
    logps = batch["logps"].clone().requires_grad_(True)
    inputs = {
        "prompt_ids": torch.zeros(B, PROMPT, dtype=torch.long),
        "prompt_mask": torch.ones(B, PROMPT, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": batch["mask"],
        "advantages": batch["advantages"],
        "old_per_token_logps": batch["old"],
        "ref_per_token_logps": batch["ref"],
        "num_items_in_batch": batch["mask"].sum(),
    }
    loss = trainer.compute_loss(FusedHeadStandIn(logps, batch["entropy"]), inputs)
    loss.backward()
    trainer.log({})
    logged = trainer.state.log_history[-1]
    metrics = {k.removeprefix("eval_"): v for k, v in logged.items() if k.startswith("eval_")}
    return loss.detach(), logps.grad, metrics


def _xtl_loss(batch: dict[str, torch.Tensor], config: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """xtl's loss of ``batch`` (its sum over its normalizer), the gradient of the log-probabilities, its metrics."""
    logps = batch["logps"].clone().requires_grad_(True)
    out = policy_loss(
        logps, batch["old"], batch["advantages"], batch["mask"], config, batch["ref"], MAX_LEN,
        entropy=batch["entropy"],
    )  # fmt: skip
    loss = out.loss_sum / out.num_items
    loss.backward()
    metrics = {name: float(value) for name, value in policy_metrics(out.stats, config).items()}
    return loss.detach(), logps.grad, metrics


CASES = [
    ("grpo", "token"),
    ("bnpo", "token"),
    ("dr_grpo", "token"),
    ("dapo", "token"),
    ("grpo", "sequence"),  # GSPO
    ("dapo", "sequence"),
]


@pytest.mark.filterwarnings("ignore:.*sums per-token contributions:UserWarning")
class TestTRLParity:
    @pytest.mark.parametrize("beta", [0.0, 0.04])
    @pytest.mark.parametrize(("loss_type", "level"), CASES)
    def test_loss_gradient_and_metrics_equal_trl(self, tiny_policy, tmp_path, loss_type, level, beta) -> None:
        batch = _batch()
        eps = (0.2, 0.28)
        expected, expected_grad, trl_metrics = _trl_loss(
            tiny_policy, tmp_path, batch, loss_type=loss_type, importance_sampling_level=level, beta=beta,
            epsilon=eps[0], epsilon_high=eps[1], use_bias_correction_kl=False,
        )  # fmt: skip
        config = PolicyLossConfig(loss_type, level, epsilon_low=eps[0], epsilon_high=eps[1], beta=beta)
        loss, grad, metrics = _xtl_loss(batch, config)
        assert abs(loss.item() - expected.item()) <= TOLERANCE, (loss.item(), expected.item())
        assert torch.allclose(grad, expected_grad, atol=TOLERANCE, rtol=0)
        shared = [name for name in SHARED_METRICS if name in trl_metrics]
        assert set(shared) == set(SHARED_METRICS) - ({"kl"} if not beta else set()), sorted(trl_metrics)
        assert set(shared) <= set(metrics), "xtl logs TRL's metrics under TRL's names"
        for name in shared:
            assert abs(metrics[name] - trl_metrics[name]) <= TOLERANCE, (name, metrics[name], trl_metrics[name])
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0, "both bounds clip"

    def test_trls_default_kl_is_weighted_by_the_ratio(self, tiny_policy, tmp_path) -> None:
        """TRL's default ``use_bias_correction_kl=True`` multiplies the KL term by the importance ratio: xtl's KL
        equals TRL's with it off only (the docs say so)."""
        batch = _batch()
        corrected, _, _ = _trl_loss(tiny_policy, tmp_path, batch, loss_type="grpo", beta=0.04)
        plain, _, _ = _trl_loss(
            tiny_policy, tmp_path, batch, loss_type="grpo", beta=0.04, use_bias_correction_kl=False
        )
        loss, _, _ = _xtl_loss(batch, PolicyLossConfig(beta=0.04))
        assert abs(loss.item() - plain.item()) <= TOLERANCE and abs(loss.item() - corrected.item()) > 1e-4

    def test_advantages_equal_trls_formula(self) -> None:
        rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0, 2.0])
        mean = rewards.view(-1, 3).mean(1).repeat_interleave(3)
        std = nanstd(rewards.view(-1, 3), dim=1).repeat_interleave(3)
        assert torch.allclose(group_advantages(rewards, 3), (rewards - mean) / (std + 1e-4))
        assert torch.equal(group_advantages(rewards, 3, "none"), rewards - mean)
        batch_std = nanstd(rewards)
        assert torch.allclose(group_advantages(rewards, 3, "batch"), (rewards - mean) / (batch_std + 1e-4))
        assert torch.equal(group_advantages(rewards, 3)[3:6], torch.zeros(3)), "an all-equal group gives no signal"

    def test_sequence_importance_with_a_token_loss_warns_as_trl(self) -> None:
        with pytest.warns(UserWarning, match="'dapo' loss sums per-token contributions"):
            PolicyLossConfig(loss_type="dapo", importance_sampling="sequence")


class TestPolicyLoss:
    def test_the_first_step_ratio_is_one_and_the_loss_is_minus_the_advantage(self) -> None:
        batch = _batch()
        out = policy_loss(batch["logps"], batch["logps"], batch["advantages"], batch["mask"], PolicyLossConfig())
        assert out.stats["clip_region"] == 0 and out.stats["ratio"] == out.stats["tokens"]
        assert torch.allclose(out.loss_sum, -batch["advantages"].sum())

    def test_gspo_clips_whole_sequences(self) -> None:
        """Under sequence-level importance sampling the clip statistics count sequences (as TRL's)."""
        batch = _batch()
        config = PolicyLossConfig(importance_sampling="sequence")
        out = policy_loss(batch["logps"], batch["old"], batch["advantages"], batch["mask"], config)
        mask = batch["mask"].double()
        ratio = torch.exp(((batch["logps"] - batch["old"]) * mask).sum(-1) / mask.sum(-1))
        low = (ratio < 0.8) & (batch["advantages"] < 0)
        high = (ratio > 1.2) & (batch["advantages"] > 0)
        assert out.stats["clip_items"] == B and out.stats["clip_region"] == (low | high).sum() > 0
        assert out.stats["clip_low"] == low.sum() and out.stats["clip_high"] == high.sum()

    def test_each_clip_statistic_uses_its_own_bound(self) -> None:
        """One-token sequences with known ratios: a ratio of 1.25 is inside DAPO's clip-higher bound (1.28) but
        above ``1 + epsilon_low``; only a ratio a bound clips (for the advantage's sign) counts."""
        ratios = torch.tensor([1.25, 1.3, 0.75, 0.85, 1.3, 0.7], dtype=torch.float64)
        advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
        config = PolicyLossConfig(epsilon_low=0.2, epsilon_high=0.28)
        logps = ratios.log().unsqueeze(-1)
        out = policy_loss(logps, torch.zeros_like(logps), advantages, torch.ones_like(logps), config)
        assert out.stats["clip_items"] == 6
        assert out.stats["clip_high"] == 1, "1.3 above 1.28 with a positive advantage; 1.25 is inside"
        assert out.stats["clip_low"] == 1, "0.75 below 0.8 with a negative advantage; 0.85 is inside"
        assert out.stats["clip_region"] == 2
        means = policy_metrics(out.stats, config)
        assert means["clip_ratio/high_mean"] == means["clip_ratio/low_mean"] == pytest.approx(1 / 6)

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

    def test_metrics_are_means_under_trls_names(self) -> None:
        batch = _batch()
        config = PolicyLossConfig(beta=0.1)
        out = policy_loss(batch["logps"], batch["old"], batch["advantages"], batch["mask"], config, batch["ref"])
        assert set(out.stats) == set(POLICY_STATS)
        means = policy_metrics(out.stats, config)
        assert set(means) == {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio", "kl",
                              "entropy"}  # fmt: skip
        assert means["kl"] == out.stats["kl"] / batch["mask"].sum()
        assert "kl" not in policy_metrics(out.stats, PolicyLossConfig()), "no KL term, no kl (as TRL)"

    def test_kl_is_zero_at_the_reference_and_positive_elsewhere(self) -> None:
        x = torch.randn(5, dtype=torch.float64)
        assert torch.equal(k3_kl(x, x), torch.zeros(5))
        assert (k3_kl(x, x + 0.3) > 0).all()

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


class TestAdvantagesWithoutRewards:
    def test_a_failed_sample_is_left_out_of_its_groups_statistics(self) -> None:
        rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0, 1.0, 0.0])
        advantages = group_advantages(rewards, 3)
        assert advantages[1].isnan() and not advantages[[0, 2, 3, 4, 5]].isnan().any()
        assert torch.allclose(advantages[[0, 2]], group_advantages(torch.tensor([1.0, 0.0]), 2))
