"""OnlineDPOModule: TRL parity of the loss, metrics and gradients, the pairing rules, the reference, fits and resume.

TRL's side is ``OnlineDPOTrainer.training_step`` itself on a tiny Qwen3 saved by transformers (a perturbed policy
and its unperturbed reference, fp64, sdpa attention), with its generation replaced by fixed completions (cut after
the first EOS by TRL's own ``truncate_right``, as its generation is) and a reward function returning fixed rewards.
xtl's side is the module's own path on the same ids and rewards: :meth:`OnlineDPOModule.build_updates` (pairs,
packing, the reference's log-probabilities) and :meth:`OnlineDPOModule.step_objective` (the pair loss, divided by the
step's pairs as the step does), with the reference a separate model (``reference: {mode: model}``, TRL's
``ref_model``). The loss, TRL's logged metrics and every parameter gradient agree within ``TOLERANCE`` (relative;
gradients against the largest of their tensor). Measured: the losses equal to the last bit, the gradients within
7e-16, the metrics within 6e-8 (TRL computes the rewards, and the reward and accuracy means, in fp32).

TRL 1.16's ``objective/kl`` and ``objective/entropy`` (and the ``non_score_reward`` and ``rlhf_reward`` made of them)
also sum the padding after a completion's EOS; xtl's sum the completion's tokens. They are compared on the case
whose completions have no padding.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from transformers import Qwen3ForCausalLM

from tests.inprocess import run_fit
from tests.train.test_base import StopAt
from tests.train.test_preference_trl import checkpoints, tokenizer  # noqa: F401 - fixtures
from tests.train.test_reference_trl import adapter  # noqa: F401 - a fixture
from xtl.callbacks import LoRA
from xtl.errors import ConfigError
from xtl.rl import FunctionJudger, OnlineDPOModule, RolloutSettings, SamplingSettings, UpdateSettings
from xtl.rl.agent import ToolLoop
from xtl.rl.buffer import Group, ProduceStats, Sample, SampleState
from xtl.rl.online_dpo import OnlineDPOLoss, rank_pairs
from xtl.train import AdamWConfig, ScheduleConfig

from .test_module import MODEL, _fit, varied_reward

with warnings.catch_warnings():  # "You are importing from 'trl.experimental'"
    warnings.simplefilter("ignore")
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    from trl.experimental.utils import truncate_right

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning")

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
BETA = 0.1
PROMPT, WIDTH = 5, 7  # prompt tokens (the same for every prompt: TRL pads prompts on the left), completion width
EOS = 2  # the tiny tokenizer's <|im_end|>
KL_METRICS = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward")


@dataclass
class Case:
    """Three prompts' completions: where each has its EOS (``None``: none, cut at ``WIDTH``) and its reward, TRL's
    order (every prompt's first completion, then every prompt's second)."""

    loss_type: str
    eos_at: list[int | None]
    rewards: list[float]
    missing_eos_penalty: float | None = None

    @property
    def padded(self) -> bool:
        return any(at is not None and at < WIDTH - 1 for at in self.eos_at)


CASES = {
    # prompt 0: the first wins, prompt 1: the second, prompt 2: a tie (the first is chosen); lengths 3 to 7
    "sigmoid": Case("sigmoid", [2, 5, 4, 5, None, 3], [1.0, 0.0, 0.5, 0.0, 1.0, 0.5]),
    # IPO on chosen and rejected completions of different lengths: length-normalizing (offline IPO) would differ
    "ipo": Case("ipo", [2, 5, 4, 5, None, 3], [1.0, 0.0, 0.5, 0.0, 1.0, 0.5]),
    # no padding; the penalty turns every ranking (prompt 1's into a tie after the penalty: the first is chosen)
    "missing_eos": Case(
        "sigmoid", [None, WIDTH - 1, None, WIDTH - 1, None, WIDTH - 1], [1.0, 0.0, 0.7, 0.5, 1.0, 0.0], 1.0
    ),
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)


def _completions(case: Case, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt ids ``(3, PROMPT)``, and the completions as TRL's generation returns them: ``(6, WIDTH)`` ids cut after
    their first EOS (``truncate_right``) and their mask."""
    generator = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 1500, (3, PROMPT), generator=generator)
    raw = torch.randint(3, 1500, (6, WIDTH), generator=generator)
    for row, at in enumerate(case.eos_at):
        if at is not None:
            raw[row, at] = EOS
    ids, mask = truncate_right(raw, [EOS], pad)
    return prompts, ids, mask


def _trl(checkpoints, tokenizer, tmp_path: Path, case: Case) -> tuple[float, dict[str, torch.Tensor], dict]:  # noqa: F811
    """``OnlineDPOTrainer.training_step`` on the case: its loss, the policy's parameter gradients (by HF name) and
    its logged statistics."""
    reference_dir, policy_dir = checkpoints
    hf = [Qwen3ForCausalLM.from_pretrained(d, attn_implementation="sdpa", dtype=torch.float64) for d in checkpoints]
    args = OnlineDPOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=3, beta=BETA, loss_type=case.loss_type,
        missing_eos_penalty=case.missing_eos_penalty, max_new_tokens=WIDTH, max_length=64, save_strategy="no",
        logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip

    def fixed_rewards(completions, **kwargs):  # noqa: ANN001, ANN202
        assert len(completions) == len(case.rewards)
        return list(case.rewards)

    trainer = OnlineDPOTrainer(
        model=hf[1], ref_model=hf[0], reward_funcs=fixed_rewards, args=args, processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list([{"prompt": "a"}] * 3),
    )  # fmt: skip
    assert trainer.eos_token_ids == [EOS] and trainer.accelerator.mixed_precision == "no"
    prompts, ids, mask = _completions(case, tokenizer.pad_token_id)
    prompt_ids = prompts.repeat(2, 1)
    trainer._generate = lambda model, prompts, images=None: (prompt_ids, torch.ones_like(prompt_ids), ids, mask, None)
    loss = trainer.training_step(trainer.model, {"prompt": ["a", "b", "c"]})
    grads = {name: p.grad for name, p in trainer.model.named_parameters()}
    return float(loss), grads, {name: values[-1] for name, values in trainer.stats.items()}


def _module(checkpoints, case: Case, **kwargs) -> OnlineDPOModule:  # noqa: F811
    """The module in fp64 with transformers' attention, its reference the unperturbed model (TRL's ``ref_model``)."""
    reference_dir, policy_dir = checkpoints
    objective = OnlineDPOLoss(beta=BETA, loss_type=case.loss_type, missing_eos_penalty=case.missing_eos_penalty)
    sdpa = {"attn_impl": "sdpa"}
    module = OnlineDPOModule(
        str(policy_dir), objective=objective, sampling=SamplingSettings(group_size=2, max_new_tokens=WIDTH),
        rollout=RolloutSettings(prompts_per_step=3), model_overrides=sdpa, param_dtype="float64",
        reference={"mode": "model", "model": str(reference_dir), "model_overrides": sdpa}, **kwargs,
    )  # fmt: skip
    module._trainer = SimpleNamespace(callbacks=[], strategy=None, global_step=0, ckpt_path=None, global_rank=0)
    with pytest.warns(UserWarning, match="param_dtype float64"):
        module.configure_model()
    module._trainer = None
    return module


def _groups(case: Case, pad: int) -> list[Group]:
    """The case's completions as the rollout groups xtl's producer makes (a prompt's first and second)."""
    prompts, ids, mask = _completions(case, pad)
    samples = []
    for row in range(6):
        response = ids[row][mask[row].bool()].tolist()
        finish = "stop" if response[-1] == EOS else "length"
        samples.append(Sample(prompts[row % 3].tolist(), response, finish, reward=case.rewards[row]))
    return [Group({"prompt": str(k)}, [samples[k], samples[3 + k]], 0) for k in range(3)]


def _xtl(module: OnlineDPOModule, groups: list[Group]) -> tuple[float, dict[str, torch.Tensor], dict[str, float]]:
    """The module's step on ``groups``: its loss (the pairs' sum over the step's pairs), the parameter gradients
    (by xtl name) and its logged metrics (without ``train/``)."""
    (update,) = module.build_updates(groups, ProduceStats())
    forward, sums = module.step_objective()
    pairs = sum(mb.num_items for mb in update)
    loss = sum(forward(module._on_device(mb)).loss_sum for mb in update) / pairs
    loss.backward()
    metrics = {k: float(v) for k, v in module.step_metrics(sums).items()}
    metrics.update({k.removeprefix("train/"): v for k, v in module._rollout_metrics.items()})
    grads = {name: p.grad for name, p in module.model.named_parameters()}
    return float(loss.detach()), grads, metrics


def _close(actual: float, expected: float, what: str) -> None:
    assert abs(actual - expected) <= TOLERANCE * max(abs(expected), 1e-3), (what, actual, expected)


class TestTRLParity:
    @pytest.mark.parametrize("name", sorted(CASES))
    def test_loss_metrics_and_gradients_equal_trls(self, checkpoints, tokenizer, tmp_path, name) -> None:  # noqa: F811
        case = CASES[name]
        trl_loss, trl_grads, trl_metrics = _trl(checkpoints, tokenizer, tmp_path, case)
        module = _module(checkpoints, case)
        loss, grads, metrics = _xtl(module, _groups(case, tokenizer.pad_token_id))
        _close(loss, trl_loss, "loss")
        assert trl_metrics["rewards/accuracies"] not in (0.0, 1.0), "some pairs ranked right, some wrong"
        for metric, value in trl_metrics.items():
            if metric in KL_METRICS and case.padded:
                continue  # TRL sums the padding too (module docstring)
            _close(metrics[metric.replace("val/", "")], value, metric)
        for xtl_name, grad in grads.items():
            trl_grad = trl_grads[xtl_name if xtl_name.startswith("lm_head") else f"model.{xtl_name}"]
            scale = float(trl_grad.abs().max())
            assert scale > 0 and float((grad - trl_grad).abs().max()) <= TOLERANCE * scale, xtl_name

    def test_the_cases_tell_the_rules_apart(self, tokenizer) -> None:  # noqa: F811
        """The IPO case's pairs differ in length (offline DPO's length-normalized IPO gives another loss there), and
        the penalty case's rankings differ with and without the penalty."""
        pairs, _ = rank_pairs(_groups(CASES["ipo"], tokenizer.pad_token_id))
        assert all(len(p.chosen.response_ids) != len(p.rejected.response_ids) for p in pairs)
        groups = _groups(CASES["missing_eos"], tokenizer.pad_token_id)
        penalized, _ = rank_pairs(groups, 1.0)
        plain, _ = rank_pairs(groups)
        flipped = [a.chosen is not b.chosen for a, b in zip(penalized, plain, strict=True)]
        assert flipped == [True, True, True]

    def test_ipo_is_not_length_normalized(self, checkpoints, tokenizer) -> None:  # noqa: F811
        """TRL's online IPO on summed log-probabilities: ``((pi_c - pi_r) - (ref_c - ref_r) - 1 / (2 beta))**2``."""
        module = _module(checkpoints, CASES["ipo"])
        groups = _groups(CASES["ipo"], tokenizer.pad_token_id)
        (update,) = module.build_updates(groups, ProduceStats())
        forward, _ = module.step_objective()
        (mb,) = update
        with torch.no_grad():
            loss = float(forward(module._on_device(mb)).loss_sum)
            policy = module._token_logps(module.model, mb)[0].sum(-1)
        reference = mb.ref_logps.sum(-1)
        logits = (policy[0::2] - policy[1::2]) - (reference[0::2] - reference[1::2])
        _close(loss, float(((logits - 1 / (2 * BETA)) ** 2).sum()), "ipo")


class TestPairs:
    @staticmethod
    def _group(*samples: tuple[float | None, str], state: SampleState = SampleState.COMPLETED) -> Group:
        made = [Sample([1], [5 + i, EOS], finish, reward=reward) for i, (reward, finish) in enumerate(samples)]
        if state != SampleState.COMPLETED:
            made[1].state = state
        return Group({}, made, 0)

    def test_a_tie_chooses_the_first(self) -> None:
        group = self._group((0.5, "stop"), (0.5, "stop"))
        (pair,), dropped = rank_pairs([group])
        assert pair.chosen is group.samples[0] and pair.rejected is group.samples[1] and dropped == 0

    def test_the_higher_reward_is_chosen(self) -> None:
        group = self._group((0.0, "stop"), (1.0, "stop"))
        (pair,), _ = rank_pairs([group])
        assert pair.chosen is group.samples[1] and (pair.chosen_score, pair.rejected_score) == (1.0, 0.0)

    def test_the_missing_eos_penalty_lowers_a_completion_cut_at_the_budget(self) -> None:
        group = self._group((1.0, "length"), (0.5, "stop"))
        (pair,), _ = rank_pairs([group], missing_eos_penalty=1.0)
        assert pair.chosen is group.samples[1] and pair.rejected_score == 0.0
        (pair,), _ = rank_pairs([group])
        assert pair.chosen is group.samples[0], "no penalty, no change"

    def test_a_failed_judging_drops_the_pair_and_is_counted(self) -> None:
        failed = self._group((1.0, "stop"), (None, "stop"), state=SampleState.FAILED)
        pairs, dropped = rank_pairs([failed, self._group((0.0, "stop"), (1.0, "stop"))])
        assert len(pairs) == 1 and dropped == 1

    def test_a_run_whose_judging_fails_logs_the_dropped_pairs(self, tmp_path) -> None:
        from .test_module import LoneJudgedSample

        steps, _ = _fit(_fit_module(judger=LoneJudgedSample(group_size=2)), 1, tmp_path)
        assert steps[1]["rollout/dropped_pairs"] == 1 and steps[1]["train/pairs"] == 2
        assert math.isfinite(steps[1]["train/loss"])


def _fit_module(**kwargs) -> OnlineDPOModule:
    """The tiny random policy: 3 prompts x 2 completions of 6 tokens per rollout batch, one step each."""
    settings = dict(
        judger=FunctionJudger(varied_reward),
        sampling=SamplingSettings(group_size=2, max_new_tokens=6),
        rollout=RolloutSettings(prompts_per_step=3),
        optimizer=AdamWConfig(lr=1e-2, weight_decay=0.0),
        schedule=ScheduleConfig(warmup_steps=0, kind="constant"),
    )
    return OnlineDPOModule(kwargs.pop("model", MODEL), **{**settings, **kwargs})


class TestReference:
    def test_fresh_lora_compares_with_the_adapters_off(self, tmp_path) -> None:
        """At the first step the policy is the reference (KL 0, rewards 0, loss ln 2); then it moves."""
        module = _fit_module()
        steps, _ = _fit(module, 2, tmp_path, [LoRA(rank=4)])
        assert module.reference.mode == "adapters_off"
        first, second = steps[1], steps[2]
        assert first["train/objective/kl"] == 0.0 and first["train/rewards/margins"] == 0.0
        assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
        assert second["train/objective/kl"] != 0.0

    def test_continued_lora_compares_with_the_starting_adapter(self, checkpoints, adapter) -> None:  # noqa: F811
        """A run that continues from a trained adapter (PEFT's, random factors): the reference is that adapter
        (``live``, no copy), so at the start the reference's log-probabilities are the policy's, and they stay while
        the policy's adapter moves."""
        module = _fit_module(model=str(checkpoints[0]))
        module._trainer = SimpleNamespace(callbacks=[LoRA(adapter_path=str(adapter))], strategy=None, global_step=0,
                                          ckpt_path=None, global_rank=0)  # fmt: skip
        module.configure_model()
        module._trainer = None
        assert module.reference.mode == "live" and module.reference.frozen is None
        groups = [TestPairs._group((0.0, "stop"), (1.0, "length"))]
        for sample in groups[0].samples:
            sample.prompt_ids = [7, 8, 9]
        with torch.no_grad():
            ((before,),) = module.build_updates(groups, ProduceStats())
            start = module._token_logps(module.model, before)[0]
            assert torch.equal(start, before.ref_logps), "the reference is the starting adapter"
            for param in module.model.parameters():
                if param.requires_grad:  # the adapter's factors
                    param.add_(0.05)
            ((after,),) = module.build_updates(groups, ProduceStats())
            moved = module._token_logps(module.model, after)[0]
        assert torch.equal(after.ref_logps, before.ref_logps) and not torch.allclose(moved, start)


class TestFit:
    def test_the_recipe_trains_and_logs_trls_metrics(self, tmp_path) -> None:
        """``xtl fit`` of ``configs/tiny_online_dpo.yaml`` with a tiny random policy, three steps: TRL's metrics are
        logged and the policy leaves the reference."""
        (tmp_path / "override.yaml").write_text(
            "trainer:\n  max_steps: 3\n  val_check_interval: null\n  limit_val_batches: 0\n  precision: 32-true\n"
            "  enable_progress_bar: false\n  callbacks: []\n"
            f"model:\n  init_args:\n    model: {dict(MODEL)}\n    sampling: {{group_size: 2, max_new_tokens: 6}}\n"
            "    rollout: {prompts_per_step: 4, dynamic_sampling: false}\n"  # the random policy's rewards all tie
            "    optimizer: {lr: 1.0e-2, weight_decay: 0.0}\n"
        )
        args = ["fit", "--config", str(ROOT / "configs" / "tiny_online_dpo.yaml"), "--config", "override.yaml"]
        rows, output = run_fit(args, tmp_path)
        assert sorted(rows) == [0, 1, 2], output[-2000:]
        names = {
            "train/rewards/chosen", "train/rewards/rejected", "train/rewards/margins", "train/rewards/accuracies",
            "train/logps/chosen", "train/logps/rejected", "train/objective/kl", "train/objective/scores_margin",
            "train/objective/rlhf_reward", "train/contain_eos_token", "train/beta", "rollout/dropped_pairs",
        }  # fmt: skip
        assert names <= set(rows[2]), names - set(rows[2])
        assert rows[0]["train/objective/kl"] == 0.0 and rows[2]["train/objective/kl"] != 0.0, "the policy moved"
        assert rows[0]["train/pairs"] == 4

    def test_a_run_stopped_mid_way_resumes_exactly(self, tmp_path) -> None:
        """Two updates per rollout batch, stopped after step 3 (an update pending): steps 4-5 equal the uninterrupted
        run's."""
        settings = dict(updates=UpdateSettings(mini_batches=2), rollout=RolloutSettings(prompts_per_step=4))
        whole, _ = _fit(_fit_module(**settings), 5, tmp_path / "a")
        first, trainer = _fit(_fit_module(**settings), 5, tmp_path / "b", [StopAt(3)], every=3)
        assert trainer.lightning_module._pending, "stopped between the updates of a rollout batch"
        resumed, _ = _fit(_fit_module(**settings), 5, tmp_path / "b", ckpt_path=str(tmp_path / "b/ckpt/last.ckpt"))
        losses = [whole[s]["train/loss"] for s in (1, 2, 3, 4, 5)]
        assert [first[s]["train/loss"] for s in (1, 2, 3)] == losses[:3]
        assert [resumed[s]["train/loss"] for s in (4, 5)] == losses[3:]
        assert resumed[4]["train/rewards/margins"] == whole[4]["train/rewards/margins"]


class TestRefusals:
    def test_a_group_size_other_than_2(self) -> None:
        with pytest.raises(ConfigError, match=r"model.init_args.sampling.group_size must be 2 .* got 4"):
            _fit_module(sampling=SamplingSettings(group_size=4))

    def test_no_reference(self) -> None:
        with pytest.raises(ConfigError, match="reference: none, but the objective compares with a reference"):
            _fit_module(reference="none")

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [({"loss_type": "hinge"}, "loss_type must be one of sigmoid, ipo"), ({"beta": 0.0}, "beta must be one number"),
         ({"beta": [0.1, 0.2]}, "beta must be one number"), ({"missing_eos_penalty": -1.0}, "missing_eos_penalty")],
    )  # fmt: skip
    def test_objective_out_of_range(self, kwargs, message) -> None:
        with pytest.raises(ConfigError, match=message):
            OnlineDPOLoss(**kwargs)

    def test_what_online_dpo_does_not_run(self) -> None:
        with pytest.raises(ConfigError, match="agent: online DPO pairs two single-turn completions"):
            _fit_module(agent=ToolLoop(["xtl.agent_tools.calculator"]))
        with pytest.raises(ConfigError, match="routing_replay"):
            _fit_module(routing_replay=True)
        with pytest.raises(ConfigError, match=r"mini_batches \(4\) exceeds the pairs"):
            _fit_module(updates=UpdateSettings(mini_batches=4))

    def test_the_reference_is_scored_at_temperature_1(self) -> None:
        module = _fit_module(sampling=SamplingSettings(group_size=2, temperature=0.7))
        assert module.scoring_temperature == 1.0
