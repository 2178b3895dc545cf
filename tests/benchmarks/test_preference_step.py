"""``benchmarks/preference_step.py``: xtl and TRL compute the same one-step loss on the same pairs, weights and
precomputed reference (DPO with RPO, KTO), and a changed pair or setting on one side breaks the check."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType

import pytest

from tests.benchmarks import load_benchmark


def _prepared(tmp_path: Path, objective: str) -> tuple[ModuleType, object]:
    """A prepared spread setup of a few pairs on a tiny Qwen3 (fp32), its loss check already passed."""
    bench = load_benchmark("preference_step")
    cfg = bench.PrefConfig(
        objective=objective, data="spread", work_dir=str(tmp_path), steps=2, threads=1, precision="32-true",
        rows=12, hidden=64, layers=1, pack=1024, median=120.0,
    )  # fmt: skip
    data = tmp_path / "pairs.jsonl"
    bench.write_spread_pairs(data, cfg.rows, cfg.seed, cfg.median, cfg.sigma)
    cfg.xtl_args = bench.xtl_args(cfg, data)
    info = bench.prepare(cfg)
    assert info["check"].startswith("same loss (asserted)")
    return bench, info["cfg"]


class TestPreferenceStepBenchmark:
    @pytest.mark.parametrize("objective", ["dpo", "kto"])
    def test_both_sides_compute_the_same_loss_and_a_changed_side_fails(self, tmp_path: Path, objective: str) -> None:
        bench, cfg = _prepared(tmp_path, objective)
        loss, pairs = bench.xtl_step_loss(cfg)
        assert loss == pytest.approx(bench.trl_step_loss(cfg, pairs), rel=bench.LOSS_RTOL["32-true"])
        other = [p + 1 if p + 1 < 12 else 0 for p in pairs]  # other pairs on TRL's side
        assert bench.trl_step_loss(cfg, other) != pytest.approx(loss, rel=bench.LOSS_RTOL["32-true"])
        key = "rpo_alpha" if objective == "dpo" else "beta"
        changed = dataclasses.replace(cfg, objective_settings={**cfg.objective_settings, key: 2.0})
        assert bench.trl_step_loss(changed, pairs) != pytest.approx(loss, rel=bench.LOSS_RTOL["32-true"])
