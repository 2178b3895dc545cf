"""``benchmarks/rl_step.py``'s two sides compute the same GRPO step: on xtl's sampled completions, TRL's reward
function (xtl's judger) gives xtl's rewards, TRL's old log-probabilities equal xtl's, and TRL's GRPO loss of a
mini-batch equals xtl's (the benchmark's own setup and check, on a smaller rollout batch)."""

from __future__ import annotations

import sys
from types import ModuleType
from unittest import mock

import pytest

from tests.benchmarks import load_benchmark

SMALL = {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6}  # the recipe's step is 16 x 8 x 12

pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning")


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModuleType, object, list, object]:
    """The benchmark's setup of a small step: the policy, the recipe parsed by xtl's CLI, xtl's prompts."""
    bench = load_benchmark("rl_step")
    cfg = bench.BenchConfig(work_dir=str(tmp_path_factory.mktemp("rl_step")), threads=1, precision="32-true", cycles=0)
    with mock.patch.object(sys, "argv", sys.argv[:1]):  # the CLI would read pytest's arguments
        cfg, prompts, judger, _ = bench.setup(cfg, **SMALL)
    return bench, cfg, prompts, judger


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


class TestRlStepBenchmark:
    def test_both_sides_compute_the_same_loss_on_the_same_completions(self, step) -> None:
        bench, cfg, prompts, judger = step
        check = bench.same_step_check(cfg, prompts, judger)
        assert len(check["rewards"]) == SMALL["prompts_per_step"] * SMALL["group_size"]
        assert check["old_logp_max_diff"] <= bench.OLD_LOGP_TOLERANCE
        assert abs(check["xtl_loss"] - check["trl_loss"]) <= bench.LOSS_TOLERANCE
        assert check["xtl_loss"] != 0.0, "a loss of 0 (no advantage, no ratio) would equal anything's"

    @pytest.mark.parametrize(
        "mutation", [{"epsilon": 0.05, "epsilon_high": 0.05}, {"importance_sampling_level": "sequence"}]
    )
    def test_the_check_fails_when_the_peer_differs(self, step, mutation) -> None:
        """A peer clipping tighter, or with one ratio per sequence (GSPO), computes another loss: the check says so."""
        bench, cfg, prompts, judger = step
        with pytest.raises(AssertionError, match="GRPO loss"):
            bench.same_step_check(cfg, prompts, judger, **mutation)
