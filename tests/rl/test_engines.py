"""The choice of rollout engine: its settings and the refusals of :func:`~xtl.rl.engines.start_engine`."""

from __future__ import annotations

import pytest
import torch

from tests.rl.test_rollout import _model
from xtl.errors import ConfigError
from xtl.rl import EngineSettings, LocalRolloutEngine
from xtl.rl.engines import start_engine


class TestEngineSettings:
    def test_refusals(self) -> None:
        with pytest.raises(ConfigError, match="model.init_args.engine.name must be one of local, vllm, ray"):
            EngineSettings(name="sglang")
        with pytest.raises(ConfigError, match="engine.ray: settings of the ray engine, but name is local"):
            EngineSettings(ray={"num_actors": 2})
        with pytest.raises(ConfigError, match="engine.importance_sampling_cap must be >= 1, got 0.5"):
            EngineSettings(importance_sampling_cap=0.5)


class TestStartEngine:
    def test_local_samples_with_the_policy_itself(self) -> None:
        model = _model()
        engine = start_engine(EngineSettings(), model, None, torch.device("cpu"))
        assert isinstance(engine, LocalRolloutEngine) and engine.model is model and engine.group is None

    def test_engines_that_sync_whole_weights_need_an_hf_directory_and_a_gpu(self, tmp_path) -> None:
        model = _model()
        with pytest.raises(ConfigError, match="engine.name: vllm starts from an HF model directory"):
            start_engine(EngineSettings("vllm"), model, None, torch.device("cpu"))
        with pytest.raises(ConfigError, match="engine.name: ray starts from an HF model directory"):
            start_engine(EngineSettings("ray"), model, None, torch.device("cpu"))
        with pytest.raises(ConfigError, match="engine.name: vllm needs a GPU"):
            start_engine(EngineSettings("vllm"), model, tmp_path, torch.device("cpu"))

    def test_lora_adapters_are_refused(self, tmp_path) -> None:
        from xtl.module.lora import add_lora

        model = _model()
        add_lora(model.get_submodule("layers.0.self_attn.q_proj"), rank=2, alpha=4.0)
        message = r"engine.name: vllm syncs whole weights, not the adapters \(LoRA\) this run trains: use local"
        with pytest.raises(ConfigError, match=message):
            start_engine(EngineSettings("vllm"), model, tmp_path, torch.device("cpu"))
