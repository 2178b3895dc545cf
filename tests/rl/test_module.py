"""GRPOModule: packed completions and their log-probabilities, the update sequence, the reference, resume, refusals."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from tests.train.test_base import StopAt
from xtl.callbacks import LoRA
from xtl.data import SourceSpec, XTLDataModule
from xtl.errors import ConfigError
from xtl.rl import (
    BaseJudger,
    FunctionJudger,
    GRPOModule,
    PolicyLossConfig,
    RolloutSettings,
    SamplingSettings,
    UpdateSettings,
)
from xtl.rl.buffer import Group, Sample, SampleState
from xtl.rl.packing import pack_sequences
from xtl.strategies import AtomicCheckpointIO
from xtl.strategies.layout import ParallelLayout
from xtl.train import AdamWConfig, ScheduleConfig

MODEL = {
    "model_type": "qwen3", "vocab_size": 1600, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "attn_impl": "sdpa",
    "tie_word_embeddings": True,
}  # fmt: skip
ARITHMETIC = r"^What (is \d|number comes after)"


def varied_reward(response: str, ground_truth: str) -> float:
    """A reward that differs between the random model's completions (so advantages are not all 0)."""
    return float(sum(map(ord, response)) % 3) / 2


def _datamodule(val: bool = False) -> XTLDataModule:
    spec = SourceSpec("tiny:sft_train.jsonl", kind="prompt", match=ARITHMETIC)
    heldout = {"heldout": [SourceSpec("tiny:sft_eval.jsonl", kind="prompt", match=ARITHMETIC)]} if val else None
    return XTLDataModule([spec], tokenizer="tiny:", val_sources=heldout, predict_batch_size=16)


def _module(rollout: dict | None = None, updates: dict | None = None, **kwargs) -> GRPOModule:
    """The tiny policy: 3 prompts x 4 completions of 6 tokens per rollout batch, 2 updates each."""
    settings = dict(
        judger=FunctionJudger(varied_reward),
        sampling=SamplingSettings(group_size=4, max_new_tokens=6),
        rollout=RolloutSettings(**{"prompts_per_step": 3, **(rollout or {})}),
        updates=UpdateSettings(**{"mini_batches": 2, **(updates or {})}),
        optimizer=AdamWConfig(lr=1e-2, weight_decay=0.0),
        schedule=ScheduleConfig(warmup_steps=0, kind="constant"),
    )
    return GRPOModule(kwargs.pop("model", MODEL), **{**settings, **kwargs})


class MetricRecorder(pl.Callback):
    """Every logged ``train/...`` and ``rollout/...`` value, per step."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps[trainer.global_step] = {k: v.item() for k, v in trainer.callback_metrics.items()}


class StartingWeights(pl.Callback):
    """The module's weights when training starts."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def _fit(module, steps, root, callbacks=(), ckpt_path=None, every=None, datamodule=None):
    recorder = MetricRecorder()
    callbacks = [recorder, *callbacks]
    if every:
        save = pl.callbacks.ModelCheckpoint
        callbacks.append(save(dirpath=root / "ckpt", every_n_train_steps=every, save_last=True, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=bool(every), default_root_dir=root,
        callbacks=callbacks, plugins=[AtomicCheckpointIO()], limit_val_batches=0,
    )  # fmt: skip
    pl.seed_everything(0)
    trainer.fit(module, datamodule=datamodule or _datamodule(), ckpt_path=ckpt_path)
    return recorder.steps, trainer


class TestPackSequences:
    def test_logps_equal_each_sequence_alone(self) -> None:
        module = _module()
        module.configure_model()
        sequences = [([5, 6, 7], [8, 9]), ([10, 11], [12, 13, 14, 15]), ([16], [17])]
        mb = pack_sequences(sequences, [1.0, -1.0, 0.5])
        assert mb.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
        logps, entropy = module._token_logps(module.model, mb, with_entropy=True)
        for i, (prompt, response) in enumerate(sequences):
            ids = torch.tensor([prompt + response])
            logits = module.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]
            torch.testing.assert_close(logps[i, : len(response)], want, rtol=0, atol=1e-5)
        assert (logps * (1 - mb.mask) == 0).all() and (entropy[mb.mask.bool()] > 0).all()


class TestTraining:
    def test_old_logps_are_kept_across_the_updates_of_a_rollout_batch(self, tmp_path) -> None:
        steps, _ = _fit(_module(), 3, tmp_path)
        first, second, third = steps[1], steps[2], steps[3]
        assert first["train/ratio"] == 1.0 and first["train/clip_ratio/region_mean"] == 0.0, "the first is on-policy"
        assert second["train/ratio"] != 1.0, "the second update of a batch compares with the sampling policy"
        assert third["train/ratio"] == 1.0, "a new rollout batch starts on-policy again"
        assert first["rollout/samples"] == 3 * 4 and first["rollout/completed"] + first["rollout/failed"] == 12
        assert first["train/frac_reward_zero_std"] < 1 and first["train/entropy"] > 0
        assert 0 < first["train/completions/min_length"] <= first["train/completions/mean_length"] <= 6
        assert first["train/completions/max_length"] <= 6 and 0 <= first["train/completions/clipped_ratio"] <= 1
        assert {"train/reward", "train/reward_std", "rollout/gen_seconds_p90", "train/clip_ratio/low_mean",
                "train/clip_ratio/high_mean"} <= set(first)  # fmt: skip
        assert "train/kl" not in first, "no KL term, no kl (as TRL)"

    def test_the_first_update_scores_the_old_logps_in_its_own_forward(self, tmp_path) -> None:
        """A rollout batch of 2 updates takes one forward without gradient (the second update's old log-probabilities):
        the first update's are its own forward's, detached (its ratio is exactly 1, see above)."""
        module = _module()
        score = module._token_logps
        grads = []

        def counted(*args, **kwargs):
            grads.append(torch.is_grad_enabled())
            return score(*args, **kwargs)

        module._token_logps = counted
        _fit(module, 2, tmp_path)
        assert grads == [False, True, True]

    def test_epochs_repeat_the_batch(self, tmp_path) -> None:
        steps, _ = _fit(_module(updates={"mini_batches": 1, "epochs": 2}), 3, tmp_path)
        assert steps[1]["train/ratio"] == 1.0 and steps[2]["train/ratio"] != 1.0 and steps[3]["train/ratio"] == 1.0

    def test_the_policy_learns_the_reward(self, tmp_path) -> None:
        """A reward for short completions (in characters): the mean reward rises (the objective really acts)."""
        module = _module(
            judger=FunctionJudger(lambda response, ground_truth: -len(response) / 10),
            sampling=SamplingSettings(group_size=8, max_new_tokens=8),
            rollout={"prompts_per_step": 4},
            updates={"mini_batches": 1},
        )
        steps, _ = _fit(module, 12, tmp_path)
        rewards = [steps[s]["train/reward"] for s in sorted(steps)]
        assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards

    @pytest.mark.parametrize("reference", ["live", "adapters_off"])
    def test_kl_to_the_reference_is_zero_first_then_positive(self, tmp_path, reference) -> None:
        callbacks = [LoRA(rank=4)] if reference == "adapters_off" else []
        module = _module(objective=PolicyLossConfig(beta=0.1), updates={"mini_batches": 1})
        steps, _ = _fit(module, 3, tmp_path, callbacks)
        assert module.reference.mode == reference
        assert steps[1]["train/kl"] == 0.0 and steps[3]["train/kl"] > 0, steps

    def test_validation_judges_greedy_answers(self, tmp_path) -> None:
        module = _module()
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             default_root_dir=tmp_path, limit_val_batches=1)  # fmt: skip
        metrics = trainer.validate(module, datamodule=_datamodule(val=True), verbose=False)[0]
        assert 0 <= metrics["val/exact_match"] <= 1 and 0 <= metrics["val/reward"] <= 1


class LoneJudgedSample(BaseJudger):
    """Judges as :func:`varied_reward`, but fails every completion of each batch's first prompt except its first:
    that one is completed and judged, yet its group has no other reward, so its advantage is ``NaN``."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    async def batch_judge(self, states):
        for i, state in enumerate(states):
            if 0 < i < self.group_size:
                state.status, state.reward, state.error = "failed", None, "scripted failure"
            else:
                state.reward = {"score": varied_reward(state.response, state.ground_truth)}
        return list(states)


class TestAdvantages:
    def test_samples_without_a_finite_advantage_do_not_train(self) -> None:
        """A failed sample (no reward) and a completed one alone in its group (``NaN`` advantage) are dropped; the
        other groups train with their advantages."""
        module = _module()
        lone = [Sample([1], [2], "stop", reward=1.0)] + [
            Sample([1], [2], "stop", state=SampleState.FAILED) for _ in range(3)
        ]
        whole = [Sample([3], [4 + i], "stop", reward=float(i % 2)) for i in range(4)]
        samples, advantages = module._advantages([Group({}, lone, 0), Group({}, whole, 0)])
        assert samples == whole and all(math.isfinite(a) for a in advantages)
        assert advantages == pytest.approx([-0.866, 0.866, -0.866, 0.866], abs=1e-3)

    def test_an_update_whose_groups_were_all_dropped_steps_without_a_gradient(self, tmp_path) -> None:
        """Every answer scores the same, so dynamic sampling drops every group: the update is a filler micro-batch
        without completions, its loss 0, and the step runs (its backward still reaches the model)."""
        module = _module(judger=FunctionJudger(lambda response, truth: 0.0), rollout=dict(dynamic_sampling=True))
        start = StartingWeights()
        steps, trainer = _fit(module, 2, tmp_path, [start])
        assert [steps[s]["train/loss"] for s in (1, 2)] == [0.0, 0.0]
        after = trainer.lightning_module.state_dict()
        assert start.weights and all(torch.equal(v, after[k]) for k, v in start.weights.items()), "no signal, no step"

    def test_a_run_whose_judging_fails_trains_on_the_judged_groups(self, tmp_path) -> None:
        module = _module(judger=LoneJudgedSample(group_size=4))
        steps, _ = _fit(module, 2, tmp_path)
        assert steps[1]["rollout/failed"] == 3 and steps[1]["rollout/completed"] == 9
        assert all(math.isfinite(steps[s]["train/loss"]) for s in (1, 2)), steps


class TestResume:
    def test_a_run_stopped_between_the_updates_of_a_batch_resumes_exactly(self, tmp_path) -> None:
        """Stopped after step 3 (an update of the second batch pending, oversampled groups in the buffer): steps 4-6
        equal the uninterrupted run's, bit for bit."""
        settings = dict(rollout=dict(dynamic_sampling=True, oversample=3.0, max_rounds=2, max_staleness=4))
        whole, _ = _fit(_module(**settings), 6, tmp_path / "a")
        first, trainer = _fit(_module(**settings), 6, tmp_path / "b", [StopAt(3)], every=3)
        assert trainer.lightning_module._pending and trainer.lightning_module.buffer.groups, "mid-batch, leftovers"
        resumed, _ = _fit(_module(**settings), 6, tmp_path / "b", ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
        losses = {s: m["train/loss"] for s, m in whole.items()}
        assert [first[s]["train/loss"] for s in (1, 2, 3)] == [losses[s] for s in (1, 2, 3)]
        assert [resumed[s]["train/loss"] for s in (4, 5, 6)] == [losses[s] for s in (4, 5, 6)]
        assert [resumed[s]["train/reward"] for s in (4, 5, 6)] == [whole[s]["train/reward"] for s in (4, 5, 6)]


class TestCheckpointState:
    """The RL state of every rank is gathered over the parallel layout's data group, and each rank restores its own
    (here rank 1 of 2, with a stand-in for the strategy's layout and meshes)."""

    GROUP = object()  # the data group's stand-in

    @pytest.fixture
    def rank_one_of_two(self, monkeypatch):
        meshes = SimpleNamespace(data=SimpleNamespace(get_local_rank=lambda: 1))
        strategy = SimpleNamespace(layout=ParallelLayout(dp_shard=2), meshes=meshes, data_group=lambda: self.GROUP)
        monkeypatch.setattr(GRPOModule, "parallelizer", property(lambda module: strategy))
        calls = []

        def all_gather_object(out, obj, group=None):
            calls.append(group)
            out[:] = [{"rollout_metrics": {"rank": 0.0}}, obj]

        monkeypatch.setattr("xtl.rl.module.dist.all_gather_object", all_gather_object)
        return calls

    def test_each_rank_restores_its_own_state(self, rank_one_of_two) -> None:
        module = _module()
        module._rollout_metrics = {"rank": 1.0}
        checkpoint: dict = {}
        module.on_save_checkpoint(checkpoint)
        assert rank_one_of_two == [self.GROUP], "gathered over the data group"
        assert [r["rollout_metrics"] for r in checkpoint["xtl_rl"]["ranks"]] == [{"rank": 0.0}, {"rank": 1.0}]
        restored = _module()
        restored.on_load_checkpoint(checkpoint)
        assert restored._rollout_metrics == {"rank": 1.0}

    def test_another_number_of_processes_is_refused(self, rank_one_of_two) -> None:
        with pytest.raises(ConfigError, match=r"rollout state of 1 process\(es\), this run has 2"):
            _module().on_load_checkpoint({"xtl_rl": {"ranks": [{}]}})


class TestRefusals:
    def test_settings_out_of_range(self) -> None:
        with pytest.raises(ConfigError, match=r"updates.mini_batches \(13\) exceeds the samples"):
            _module(updates={"mini_batches": 13})
        with pytest.raises(ConfigError, match="reference: none, but the objective compares with a reference"):
            _module(objective=PolicyLossConfig(beta=0.1), reference="none")
        with pytest.raises(ConfigError, match=r"rollout.overlong_buffer must be in \(0, sampling.max_new_tokens=6\]"):
            _module(rollout={"overlong_buffer": 7})

    def test_flat_keys_of_earlier_releases_name_their_group(self) -> None:
        with pytest.raises(
            ConfigError, match="prompts_per_step has moved to model.init_args.rollout.prompts_per_step"
        ):
            _module(prompts_per_step=3)
        with pytest.raises(
            ConfigError, match="importance_sampling_cap has moved to model.init_args.engine.importance"
        ):
            _module(importance_sampling_cap=3.0)
        with pytest.raises(ConfigError, match="model.init_args.engine: vllm has moved to model.init_args.engine.name"):
            _module(engine="vllm")

    def test_data_that_is_not_prompts(self, tmp_path) -> None:
        datamodule = XTLDataModule([SourceSpec("tiny:sft_train.jsonl")], tokenizer="tiny:", pack_max_length=256)
        with pytest.raises(ConfigError, match="kind: prompt"):
            _fit(_module(), 1, tmp_path, datamodule=datamodule)

    def test_adapters_off_without_lora(self, tmp_path) -> None:
        with pytest.raises(ConfigError, match="adapters_off needs LoRA"):
            _module(objective=PolicyLossConfig(beta=0.1), reference="adapters_off").configure_model()


class DispatchLog(pl.Callback):
    """The experts each MoE layer's router would choose and the ones its tokens were sent to, per forward."""

    def __init__(self) -> None:
        self.natural: list[torch.Tensor] = []
        self.dispatched: list[torch.Tensor] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        block = pl_module.model.moe_blocks()[0]
        gate_forward, dispatch = block.gate.forward, block.dispatcher.dispatch

        def gate(hidden):
            out = gate_forward(hidden)
            self.natural.append(out.topk_ids.clone())
            return out

        def send(hidden, ids, weights):
            self.dispatched.append(ids.clone())
            return dispatch(hidden, ids, weights)

        block.gate.forward, block.dispatcher.dispatch = gate, send


class TestRoutingReplay:
    MOE = {**MODEL, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}

    def test_the_updates_route_as_the_rollout_forward_did(self, tmp_path) -> None:
        log = DispatchLog()
        module = GRPOModule(
            self.MOE, judger=FunctionJudger(varied_reward), sampling=SamplingSettings(group_size=4, max_new_tokens=6),
            rollout=RolloutSettings(prompts_per_step=3), updates=UpdateSettings(mini_batches=2), routing_replay=True,
            optimizer=AdamWConfig(lr=5e-2),
            schedule=ScheduleConfig(warmup_steps=0, kind="constant"),
        )  # fmt: skip
        steps, _ = _fit(module, 2, tmp_path, [log])
        assert steps[1]["train/ratio"] == 1.0
        # forwards of the first rollout batch: decoding, then the old log-probabilities (recorded), update 1, update 2
        recorded, second = log.dispatched[-3], log.dispatched[-1]
        assert torch.equal(second, recorded), "the second update is routed as recorded"
        assert not torch.equal(log.natural[-1], recorded), "while its router would now choose other experts"

    def test_refused_without_routed_experts(self) -> None:
        with pytest.raises(ConfigError, match="no routed experts"):
            _module(routing_replay=True).configure_model()


class TestEngineLogprobs:
    def test_engine_log_probs_weight_the_tokens_and_weights_sync_once_per_batch(self, tmp_path) -> None:
        from xtl.rl import LocalRolloutEngine

        class WithLogprobs(LocalRolloutEngine):
            syncs = 0

            def generate(self, prompts, sampling, stop_token_ids=()):
                rollouts = super().generate(prompts, sampling, stop_token_ids)
                for r in rollouts:
                    r.logprobs = [-0.5] * len(r.response_ids)
                return rollouts

            def sync_weights(self, model):
                WithLogprobs.syncs += 1

        plain, _ = _fit(_module(), 4, tmp_path / "plain")
        module = _module()
        module._start_engine = lambda: WithLogprobs(module.model)
        weighted, _ = _fit(module, 4, tmp_path / "weighted")
        assert WithLogprobs.syncs == 2, "one sync per rollout batch (4 steps, 2 per batch)"
        assert weighted[1]["train/reward"] == plain[1]["train/reward"], "the same rollouts"
        assert weighted[1]["train/loss"] != plain[1]["train/loss"], "weighted by min(exp(old - engine), cap)"
