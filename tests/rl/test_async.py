"""Asynchronous rollouts (a producer thread and Ray actors): ``max_staleness: 0`` is the synchronous run bit for bit,
``max_staleness: 1`` samples each batch with the weights of one step before, logs it, and a stopped run resumes
exactly. Partial rollouts pause and continue completions; several tasks share each batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from tests.inprocess import run_fit
from tests.rl.test_module import ARITHMETIC, MODEL, _fit, _module, varied_reward
from tests.seeded_model import save_seeded_model
from tests.train.test_base import StopAt
from xtl.data import SourceSpec, XTLDataModule
from xtl.errors import ConfigError
from xtl.rl import ComposedJudger, EngineSettings, FunctionJudger, RolloutSettings
from xtl.rl.tasks import TaskMix

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def hf_policy(tmp_path_factory) -> str:
    """The tiny policy as an HF directory (the actors start from it)."""
    return str(save_seeded_model(MODEL, tmp_path_factory.mktemp("policy") / "hf"))


def _async(hf_policy: str, staleness: int, asynchronous: bool = True, **rollout):
    engine = EngineSettings("ray", ray={"num_actors": 1, "actor_options": {"num_cpus": 0}})
    return _module(rollout={"asynchronous": asynchronous, "max_staleness": staleness, **rollout}, engine=engine,
                   model=hf_policy)  # fmt: skip


def _cli_fit(work: Path, policy: str, *extra: str) -> dict[int, dict[str, float]]:
    """``xtl fit`` (2 FSDP ranks, asynchronous, a reward that varies between completions) in ``work``; the rows of
    rank 0's log by step."""
    work.mkdir(parents=True)
    (work / "override.yaml").write_text(
        "trainer:\n  devices: 2\n  precision: 32-true\n  max_steps: 6\n  val_check_interval: null\n"
        "  limit_val_batches: 0\n  enable_progress_bar: false\n  callbacks: []\n  strategy:\n"
        "    class_path: xtl.strategies.FSDPStrategy\n    init_args:\n      process_group_backend: gloo\n"
        f"model:\n  init_args:\n    model: {policy}\n"
        "    judger: {class_path: xtl.rl.FunctionJudger, init_args: {fn: 'tests.rl.test_module:varied_reward'}}\n"
        "    sampling: {group_size: 2, max_new_tokens: 6}\n"
        "    rollout: {prompts_per_step: 3, asynchronous: true, max_staleness: 1, oversample: 1.0, max_rounds: 3}\n"
        "    engine: {name: ray, ray: {num_actors: 1, actor_options: {num_cpus: 0}}}\n"
    )
    args = ["fit", "--config", str(ROOT / "configs" / "tiny_grpo.yaml"), "--config", str(work / "override.yaml")]
    return run_fit([*args, *extra], work, processes=True)[0]


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}


class TestStaleness:
    def test_staleness_zero_is_the_synchronous_run_bit_for_bit(self, local_ray, hf_policy, tmp_path) -> None:
        """Same losses, rewards, rollouts and final weights (4 steps: 2 rollout batches of 2 updates)."""
        sync, sync_trainer = _fit(_async(hf_policy, 0, asynchronous=False), 4, tmp_path / "sync")
        done, async_trainer = _fit(_async(hf_policy, 0), 4, tmp_path / "async")
        for step in sync:
            for key in ("train/loss", "train/reward", "rollout/tokens", "train/clip_ratio/region_mean"):
                assert done[step][key] == sync[step][key], (step, key)
            assert done[step]["rollout/staleness_max"] == 0.0
        final, reference = _weights(async_trainer), _weights(sync_trainer)
        assert all(torch.equal(final[k], reference[k]) for k in reference)

    def test_staleness_one_samples_with_the_weights_one_step_back(self, local_ray, hf_policy, tmp_path) -> None:
        """Batch n (steps 2n, 2n+1) is sampled with policy version n - 1 (the weights after batch n - 1's updates):
        logged as its version and a staleness of 1; the run trains something else than the synchronous one."""
        sync, _ = _fit(_async(hf_policy, 0), 6, tmp_path / "sync")
        done, trainer = _fit(_async(hf_policy, 1), 6, tmp_path / "async")
        assert [done[s]["rollout/version"] for s in (1, 3, 5)] == [0.0, 0.0, 1.0]
        assert [done[s]["rollout/staleness_max"] for s in (1, 3, 5)] == [0.0, 1.0, 1.0]
        assert done[1]["train/loss"] == sync[1]["train/loss"], "the first batch: the starting weights either way"
        assert done[3]["train/reward"] != sync[3]["train/reward"] or done[3]["train/loss"] != sync[3]["train/loss"]
        assert trainer.lightning_module._producer is None, "stopped at the end of fit"

    @pytest.mark.parametrize("after_setup", [False, True], ids=["restore_first", "restore_after_setup"])
    def test_a_stopped_run_resumes_with_the_losses_of_the_uninterrupted_one(
        self, local_ray, hf_policy, tmp_path, monkeypatch, after_setup
    ) -> None:
        """Stopped after step 3 (mid-batch, the next batch produced ahead): steps 4-6 equal, bit for bit. Sharded
        strategies restore the checkpoint after ``on_fit_start`` (``restore_after_setup``): the producer must start
        from the restored state, not from batch 0."""
        whole, _ = _fit(_async(hf_policy, 1), 6, tmp_path / "a")
        first, trainer = _fit(_async(hf_policy, 1), 6, tmp_path / "b", [StopAt(3)], every=3)
        monkeypatch.setattr(SingleDeviceStrategy, "restore_checkpoint_after_setup", property(lambda _: after_setup))
        resumed, _ = _fit(
            _async(hf_policy, 1), 6, tmp_path / "b", ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt")
        )
        assert [first[s]["train/loss"] for s in (1, 2, 3)] == [whole[s]["train/loss"] for s in (1, 2, 3)]
        for step in (4, 5, 6):
            for key in ("train/loss", "train/reward", "rollout/version"):
                assert resumed[step][key] == whole[step][key], (step, key)


@pytest.mark.distributed
class TestShardedResume:
    def test_two_fsdp_ranks_resume_with_the_losses_of_the_uninterrupted_run(self, hf_policy, tmp_path) -> None:
        """``xtl fit`` of the tiny GRPO recipe on 2 FSDP ranks (each with its own Ray actor), ``max_staleness: 1``:
        6 steps with checkpoints every 2; resumed from step 2 (a produced batch in the checkpoint, the next one
        produced after the restart), steps 2-5 equal. The ranks do not agree on dynamic sampling's rounds, so each
        draws its own number of prompts: each rank's draws are in the checkpoint, not only rank 0's."""
        full = _cli_fit(tmp_path / "full", hf_policy, "--trainer.callbacks+=ModelCheckpoint",
                        "--trainer.callbacks.dirpath=ckpt", "--trainer.callbacks.every_n_train_steps=2",
                        "--trainer.callbacks.save_top_k=-1")  # fmt: skip
        (ckpt,) = (tmp_path / "full" / "runs").glob("*/ckpt/*step=2.ckpt")
        resumed = _cli_fit(tmp_path / "resumed", hf_policy, "--ckpt_path", str(ckpt))
        assert [full[s]["rollout/staleness_max"] for s in (3, 5)] == [1.0, 1.0]
        assert [resumed[s]["train/loss"] for s in range(2, 6)] == [full[s]["train/loss"] for s in range(2, 6)]


class TestRefusals:
    def test_asynchronous_needs_an_engine_in_other_processes(self) -> None:
        with pytest.raises(ConfigError, match="engine.name: ray"):
            _module(rollout={"asynchronous": True})

    def test_partial_rollouts_are_single_turn(self) -> None:
        from xtl.rl.agent import ToolLoop

        with pytest.raises(ConfigError, match="partial_tokens"):
            _module(rollout={"partial_tokens": 4}, agent=ToolLoop(["xtl.agent_tools.calculator"]))


class TestPartialRollouts:
    def test_paused_completions_continue_in_later_batches_and_a_stopped_run_resumes_exactly(self, tmp_path) -> None:
        """2-token rounds of 6-token completions (local engine): completions pause, continue in later batches (with
        the log-probabilities of the weights that sampled each token), and a run stopped after step 3 with paused
        groups in the buffer resumes bit for bit."""
        settings = dict(rollout={"partial_tokens": 2, "max_resumes": 3, "max_staleness": 4})
        whole, trainer = _fit(_module(**settings), 8, tmp_path / "a")
        assert sum(m["rollout/resumed"] for m in whole.values()) > 0 and max(
            m["rollout/aborted"] for m in whole.values()
        )
        assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in whole.values())
        assert type(trainer.lightning_module.engine).__name__ == "LocalRolloutEngine"
        assert trainer.lightning_module.engine.logprobs, "behavior log-probabilities for the importance weights"
        first, trainer = _fit(_module(**settings), 8, tmp_path / "b", [StopAt(3)], every=3)
        assert trainer.lightning_module.buffer.partial, "paused groups in the checkpoint"
        resumed, _ = _fit(_module(**settings), 8, tmp_path / "b", ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
        for step in range(4, 9):
            assert resumed[step]["train/loss"] == whole[step]["train/loss"], step
            assert resumed[step]["rollout/resumed"] == whole[step]["rollout/resumed"], step


def _two_tasks() -> XTLDataModule:
    """Arithmetic and repeat prompts as two tasks (their data_source)."""
    sources = [
        SourceSpec("tiny:sft_train.jsonl", kind="prompt", match=ARITHMETIC, data_source="arithmetic"),
        SourceSpec("tiny:sft_train.jsonl", kind="prompt", match=r"^Repeat:", data_source="repeat"),
    ]
    return XTLDataModule(sources, tokenizer="tiny:", predict_batch_size=16)


def _constant(value: float):
    return lambda response, ground_truth: value


class TestTasks:
    def test_each_batch_draws_each_task_by_its_share_and_judges_and_logs_it_apart(self, tmp_path) -> None:
        """Shares 2:1 of 3 prompts: 2 arithmetic and 1 repeat group per batch, each scored by its own branch of
        the composed judger (rewards in [0, 1], and -1), logged per task; a stopped run resumes each task's draws
        exactly."""
        judger = ComposedJudger(
            {"arithmetic": FunctionJudger(varied_reward), "repeat": FunctionJudger(_constant(-1.0))}
        )
        settings = dict(rollout={"tasks": {"arithmetic": 2, "repeat": 1}}, judger=judger)
        whole, trainer = _fit(_module(**settings), 4, tmp_path / "a", datamodule=_two_tasks())
        for metrics in whole.values():
            assert metrics["rollout/task/arithmetic/groups"] == 2.0 and metrics["rollout/task/repeat/groups"] == 1.0
            assert 0.0 <= metrics["rollout/task/arithmetic/reward_mean"] <= 1.0
            assert metrics["rollout/task/repeat/reward_mean"] == -1.0
        prompts = trainer.datamodule.prompts
        assert prompts.task_consumed == {"arithmetic": 4, "repeat": 2} and prompts.consumed == 0
        _fit(_module(**settings), 4, tmp_path / "b", [StopAt(2)], every=2, datamodule=_two_tasks())
        resumed, trainer = _fit(_module(**settings), 4, tmp_path / "b", datamodule=_two_tasks(),
                                ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))  # fmt: skip
        assert [resumed[s]["train/loss"] for s in (3, 4)] == [whole[s]["train/loss"] for s in (3, 4)]
        assert all(whole[s]["train/loss"] != 0.0 for s in (3, 4)), "the arithmetic groups carry a signal"
        assert trainer.datamodule.prompts.task_consumed == {"arithmetic": 4, "repeat": 2}

    def test_a_task_without_rows_is_refused_at_setup(self, tmp_path) -> None:
        with pytest.raises(ConfigError, match="no prompt row has data_source 'code'"):
            _fit(_module(rollout={"tasks": {"arithmetic": 1, "code": 1}}), 1, tmp_path, datamodule=_two_tasks())

    def test_shares_split_counts_by_largest_remainder(self) -> None:
        mix = TaskMix({"a": 2, "b": 1})
        assert mix.counts(3) == {"a": 2, "b": 1} and mix.counts(4) == {"a": 3, "b": 1}
        assert mix.counts(1) == {"a": 1, "b": 0} and sum(mix.counts(7).values()) == 7
        with pytest.raises(ConfigError, match="rollout.tasks.b must be a share > 0"):
            RolloutSettings(tasks={"a": 1, "b": 0})
