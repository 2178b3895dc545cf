"""``benchmarks/rl_step.py --async`` runs what it says: the synchronous side on the local engine, the asynchronous
one on a Ray actor with a staleness of 1, each counting the samples of every rollout batch (a shrunk recipe; nothing
is timed here)."""

from __future__ import annotations

import sys
from unittest import mock

import pytest
import torch

from tests.benchmarks import load_benchmark

SMALL = [
    "--model.init_args.rollout.prompts_per_step=2", "--model.init_args.sampling.group_size=4",
    "--model.init_args.sampling.max_new_tokens=4", "--model.init_args.rollout.dynamic_sampling=false",
    "--model.init_args.rollout.oversample=1.0", "--model.init_args.rollout.max_rounds=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("policy")
    config = Qwen3Config(
        vocab_size=1600, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return str(path)


class TestRlAsyncBenchmark:
    @pytest.mark.parametrize("side", ["sync", "async"])
    def test_each_side_runs_its_configuration_and_counts_its_samples(self, side, policy, tmp_path) -> None:
        bench = load_benchmark("rl_async")
        cfg = bench.RunConfig(side, policy, str(tmp_path), 6, "32-true", overrides=SMALL)
        with mock.patch.object(sys, "argv", sys.argv[:1]):
            result = bench.run_side(cfg)
        assert result.samples == [8.0, 8.0, 8.0], "3 rollout batches of 2 prompts x 4"
        assert result.staleness == ([0.0, 1.0, 1.0] if side == "async" else [0.0, 0.0, 0.0])
        assert result.samples_per_s > 0 and len(result.batch_ends) == 3

    def test_a_missing_policy_says_how_to_make_it(self, tmp_path) -> None:
        bench = load_benchmark("rl_async")
        with pytest.raises(SystemExit, match="make the tiny SFT export first"):
            bench.main(["--policy", str(tmp_path / "none")])
