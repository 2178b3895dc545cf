"""Rollout and judging on Ray actors (a local Ray instance): the same results as in process."""

from __future__ import annotations

import pytest
import ray
import torch

from xtl.rl import ExactMatchJudger, LocalRolloutEngine, RolloutState, SamplingSettings
from xtl.rl.remote import RayJudger, RayRolloutEngine, load_hf_named_tensors
from xtl.rl.rollout import hf_named_tensors

MODEL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, attn_impl="sdpa", tie_word_embeddings=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _model(seed: int = 0):
    from xtl.model import MODEL_TYPES

    with torch.device("meta"):
        model = MODEL_TYPES["qwen3"](**MODEL).build()
    model.materialize("cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model.float()


class TestRayJudger:
    def test_actors_judge_as_the_judger_does_and_a_dead_actor_fails_its_states_only(self, local_ray) -> None:
        states = [RolloutState(str(i % 3), "1") for i in range(6)]
        judger = RayJudger(ExactMatchJudger(), num_actors=2)
        judged = judger.judge_sync(states)
        assert [s.reward["score"] for s in judged] == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
        ray.kill(judger._actors[1])
        again = judger.judge_sync([RolloutState(str(i % 3), "1") for i in range(6)])
        assert [s.status for s in again] == ["completed", "failed"] * 3
        assert again[0].reward == {"score": 0.0} and "judger actor" in again[1].error


class TestRayRolloutEngine:
    def test_actors_sample_what_the_local_sampler_does_with_the_synced_weights(self, local_ray, tmp_path) -> None:
        _model(seed=1).save_hf(tmp_path)  # the actors start from other weights than the policy's
        policy = _model(seed=0)
        engine = RayRolloutEngine(str(tmp_path), num_actors=2)
        engine.sync_weights(policy)
        sampling = SamplingSettings(group_size=2, max_new_tokens=5, seed=7)
        prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
        remote = engine.generate(prompts, sampling)
        local = []
        for i, share in enumerate([prompts[:2], prompts[2:]]):
            from dataclasses import replace

            local += LocalRolloutEngine(policy).generate(share, replace(sampling, seed=7 + i))
        assert [r.response_ids for r in remote] == [r.response_ids for r in local]
        state = engine.state_dict()
        after = engine.generate(prompts, sampling)
        engine.load_state_dict(state)
        assert [r.response_ids for r in engine.generate(prompts, sampling)] == [r.response_ids for r in after]

    def test_hf_named_tensors_load_back(self) -> None:
        source, target = _model(seed=0), _model(seed=1)
        load_hf_named_tensors(target, dict(hf_named_tensors(source)))
        for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items(), strict=True):
            assert torch.equal(a, b), name


class TestGRPOOnRay:
    def test_a_run_samples_on_ray_actors(self, local_ray, tmp_path) -> None:
        import lightning.pytorch as pl

        from tests.rl.test_module import MODEL as TINY
        from tests.rl.test_module import _datamodule, varied_reward
        from xtl.model import MODEL_TYPES
        from xtl.rl import EngineSettings, FunctionJudger, GRPOModule, RolloutSettings

        config = dict(TINY)
        with torch.device("meta"):
            model = MODEL_TYPES[config.pop("model_type")](**config).build()
        model.materialize("cpu")
        model.init_weights()
        model.save_hf(tmp_path / "hf")
        module = GRPOModule(
            str(tmp_path / "hf"), judger=FunctionJudger(varied_reward), sampling=SamplingSettings(group_size=4,
            max_new_tokens=4), rollout=RolloutSettings(prompts_per_step=2), engine=EngineSettings("ray",
            ray={"num_actors": 1}),
        )  # fmt: skip
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                             enable_checkpointing=False, default_root_dir=tmp_path, limit_val_batches=0)  # fmt: skip
        trainer.fit(module, datamodule=_datamodule())
        assert type(module.engine).__name__ == "RayRolloutEngine"
        assert trainer.callback_metrics["rollout/samples"].item() == 8
        assert torch.isfinite(trainer.callback_metrics["train/loss"])

    def test_actors_run_with_the_threads_asked_for(self, local_ray, tmp_path) -> None:
        _model().save_hf(tmp_path)
        engine = RayRolloutEngine(str(tmp_path), num_actors=1, num_threads=2, actor_options={"num_cpus": 0})
        threads = ray.get(engine.actors[0].__ray_call__.remote(lambda actor: torch.get_num_threads()))
        assert threads == 2
        with pytest.raises(ValueError, match="num_threads"):
            RayRolloutEngine(str(tmp_path), num_threads=0)
