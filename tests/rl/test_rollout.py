"""Rollout engines: the local sampler, and the vLLM engine's logic with a stand-in for vLLM (the real one: ``gpu``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from xtl.errors import ConfigError
from xtl.model.hf import CheckpointReader
from xtl.rl import LocalRolloutEngine, SamplingSettings, VLLMRolloutEngine, VLLMSettings
from xtl.rl.rollout import hf_named_tensors
from xtl.train.generation import GenerationConfig

MODEL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, attn_impl="sdpa", tie_word_embeddings=True,
)  # fmt: skip


def _model():
    from xtl.model import MODEL_TYPES

    with torch.device("meta"):
        model = MODEL_TYPES["qwen3"](**MODEL).build()
    model.materialize("cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model.float()


class FakeLLM:
    """vLLM's ``LLM`` as the engine uses it: answers prompt ``p`` with ``p[-1] + 1, p[-1] + 2, ...`` until a stop
    token or ``max_tokens``; records loaded weights."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.resets = 0
        self.params: list[dict] = []
        loader = SimpleNamespace(load_weights=lambda pairs: self.loaded.extend(pairs))
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=loader)))
        )

    def generate(self, prompts, params, use_tqdm=False):
        self.params.append(params)
        outs = []
        for prompt in prompts:
            ids, last = [], prompt["prompt_token_ids"][-1]
            while len(ids) < params["max_tokens"]:
                last += 1
                ids.append(last)
                if last in params["stop_token_ids"]:
                    break
            reason = "stop" if ids[-1] in params["stop_token_ids"] else "length"
            logprobs = [{t: SimpleNamespace(logprob=-0.1 * t)} for t in ids]
            completion = SimpleNamespace(token_ids=ids, logprobs=logprobs, finish_reason=reason)
            outs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=[completion]))
        return outs

    def reset_prefix_cache(self) -> None:
        self.resets += 1


def _vllm(llm: FakeLLM) -> VLLMRolloutEngine:
    return VLLMRolloutEngine("unused", VLLMSettings(), seed=3, llm=llm, params_class=dict)


class TestVLLMEngineLogic:
    def test_rollouts_carry_tokens_finish_reasons_and_log_probs(self) -> None:
        llm = FakeLLM()
        engine = _vllm(llm)
        sampling = SamplingSettings(group_size=2, temperature=0.7, top_p=0.9, max_new_tokens=4, seed=5)
        out = engine.generate([[1, 2], [10]], sampling, stop_token_ids=[4])
        assert [r.response_ids for r in out] == [[3, 4], [11, 12, 13, 14]]
        assert [r.finish_reason for r in out] == ["stop", "length"]
        assert out[0].logprobs == pytest.approx([-0.3, -0.4]) and out[0].prompt_ids == [1, 2]
        params = llm.params[0]
        assert params["temperature"] == 0.7 and params["top_p"] == 0.9 and params["top_k"] == -1
        assert params["logprobs"] == 0 and params["stop_token_ids"] == [4] and params["n"] == 1

    def test_each_call_has_its_own_seed_and_the_count_resumes(self) -> None:
        engine = _vllm(FakeLLM())
        sampling = SamplingSettings(group_size=2, max_new_tokens=2, seed=5)
        engine.generate([[1]], sampling)
        engine.generate([[1]], sampling)
        seeds = [p["seed"] for p in engine.llm.params]
        assert len(set(seeds)) == 2
        restored = _vllm(FakeLLM())
        restored.load_state_dict(engine.state_dict())
        restored.generate([[1]], sampling)
        fresh = _vllm(FakeLLM())
        for _ in range(3):
            fresh.generate([[1]], sampling)
        assert restored.llm.params[-1]["seed"] == fresh.llm.params[-1]["seed"]

    def test_sync_streams_the_hf_weights_and_resets_the_cache(self, tmp_path) -> None:
        model = _model()
        llm = FakeLLM()
        _vllm(llm).sync_weights(model)
        model.save_hf(tmp_path)
        reader = CheckpointReader(tmp_path)
        assert sorted(name for name, _ in llm.loaded) == sorted(reader.keys())
        for name, tensor in llm.loaded:
            assert torch.equal(tensor, reader.load(name).to(tensor.dtype)), name
        assert llm.resets == 1

    def test_hf_names_of_a_moe_model(self) -> None:
        from xtl.model import MODEL_TYPES

        with torch.device("meta"):
            model = MODEL_TYPES["qwen3_moe"](
                **MODEL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
            ).build()
        model.materialize("cpu")
        names = [name for name, _ in hf_named_tensors(model)]
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in names and len(names) == len(set(names))


class TestSamplingSettings:
    def test_a_generation_config_with_rls_group_size_and_defaults(self) -> None:
        sampling = SamplingSettings(group_size=4, top_k=5, stop_token_ids=[7], seed=3)
        assert isinstance(sampling, GenerationConfig) and sampling.do_sample
        assert (sampling.temperature, sampling.max_new_tokens) == (1.0, 64), "RL samples by default"
        config = sampling.generation_config(stop_token_ids=[9, 7])
        assert type(config) is GenerationConfig and config.stop_token_ids == (7, 9)
        assert (config.top_k, config.seed, config.temperature, config.max_new_tokens) == (5, 3, 1.0, 64)

    @pytest.mark.parametrize(
        ("settings", "says"),
        [
            ({"group_size": 1}, "model.init_args.sampling.group_size must be >= 2"),
            ({"temperature": 0.0}, "model.init_args.sampling.temperature must be > 0 for sampling"),
            ({"max_new_tokens": 0}, "model.init_args.sampling.max_new_tokens must be >= 1"),
            ({"top_p": 1.5}, r"model.init_args.sampling.top_p must be in \(0, 1\]"),
        ],
    )
    def test_out_of_range(self, settings, says) -> None:
        with pytest.raises(ConfigError, match=says):
            SamplingSettings(**settings)


class TestLocalEngine:
    def test_samples_resume_from_the_generator_state(self) -> None:
        model = _model()
        sampling = SamplingSettings(group_size=2, max_new_tokens=5, seed=1)
        engine = LocalRolloutEngine(model)
        engine.generate([[1, 2, 3]] * 2, sampling)
        state = engine.state_dict()
        after = engine.generate([[1, 2, 3]] * 2, sampling)
        restored = LocalRolloutEngine(model)
        restored.load_state_dict(state)
        assert [r.response_ids for r in restored.generate([[1, 2, 3]] * 2, sampling)] == [
            r.response_ids for r in after
        ]
        assert all(r.finish_reason == "length" and len(r.response_ids) == 5 for r in after)


@pytest.mark.gpu
class TestVLLMEngine:
    def test_a_real_engine_follows_the_synced_weights(self, tmp_path) -> None:
        pytest.importorskip("vllm")
        if not torch.cuda.is_available():
            pytest.skip("vLLM needs a GPU")
        model = _model()
        model.save_hf(tmp_path)
        engine = VLLMRolloutEngine(str(tmp_path), VLLMSettings(gpu_memory_utilization=0.2, max_model_len=64))
        sampling = SamplingSettings(group_size=2, temperature=1.0, max_new_tokens=4, seed=0)
        before = engine.generate([[1, 2, 3]], sampling)[0]
        assert len(before.logprobs) == len(before.response_ids)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.0)
        engine.sync_weights(model.cuda())
        engine.load_state_dict({"calls": 0})  # the same seed as the first call
        after = engine.generate([[1, 2, 3]], sampling)[0]
        assert after.logprobs != before.logprobs
