"""The rollout trace callback on a tiny GRPO run: every sample's stages are traced, and the page's counts equal the
logged batch accounting."""

from __future__ import annotations

import json
import re

import pytest

from tests.rl.test_module import _fit, _module, varied_reward
from xtl.callbacks import RolloutTrace
from xtl.errors import ConfigError
from xtl.rl import FunctionJudger, trace
from xtl.rl.buffer import SampleState
from xtl.rl.trace_viewer import load_spans

STATES = [state.value for state in SampleState]


def odd_answers_score_nothing(response: str, ground_truth: str) -> float:
    """Equal rewards (dynamic sampling filters the group) for odd answers, varied ones for the others."""
    return 0.0 if ground_truth.strip()[-1:] in "13579" else varied_reward(response, ground_truth)


def _page_data(path) -> dict:
    html = path.read_text()
    match = re.search(r'<script type="application/json" id="xtl-trace-data">(.*?)</script>', html, re.DOTALL)
    return json.loads(match.group(1))


class TestRolloutTrace:
    def test_the_page_shows_every_sample_and_its_counts_equal_the_logged_accounting(self, tmp_path) -> None:
        """Dynamic sampling with oversampling (filtered groups, leftovers in the buffer), one update per batch: per
        step, the page's samples by state equal the logged ``rollout/<state>`` counts, and each trained sample has
        its agent loop, generation and judging stages."""
        settings = dict(
            rollout={"dynamic_sampling": True, "oversample": 2.0, "max_rounds": 2}, updates={"mini_batches": 1},
            judger=FunctionJudger(odd_answers_score_nothing),
        )  # fmt: skip
        logged, trainer = _fit(_module(**settings), 4, tmp_path, [RolloutTrace()])
        spans = load_spans(tmp_path / "traces.jsonl")
        assert spans and not any(k in json.dumps(s["attributes"]) for s in spans for k in ("prompt", "What is"))
        data = _page_data(tmp_path / "traces.html")
        steps = {step["step"]: step for step in data["steps"]}
        filtered = 0
        for step in range(4):
            counts, metrics = steps[step]["counts"], logged[step + 1]
            assert {s: counts.get(s, 0) for s in STATES} == {s: int(metrics[f"rollout/{s}"]) for s in STATES}, step
            filtered += counts.get("filtered", 0)
            for sample in steps[step]["samples"]:
                born = int(sample["id"].split(".")[0])  # a leftover group trains in a later batch
                first = next(s for s in steps[born]["samples"] if s["id"] == sample["id"])
                assert {"agent_loop", "generate"} <= set(first["stages"]), sample
                assert "produce_batch -> SingleTurnLoop.rollout -> engine.generate" in first["chain"], first["chain"]
                if sample["status"] == "completed":
                    assert "judge" in first["stages"] and sample["reward"] is not None
        assert filtered > 0, "the run filtered groups: the test covers that state"
        assert any(s["attributes"].get("filter_reason") == "equal rewards" for s in spans)
        assert trace.current() is trace.NULL_TRACER, "deactivated at the end of fit"

    def test_refused_without_rollouts(self, tmp_path) -> None:
        import lightning.pytorch as pl

        from xtl.train import LanguageModule

        callback = RolloutTrace()
        with pytest.raises(ConfigError, match="RolloutTrace traces RL rollouts"):
            callback.setup(pl.Trainer(logger=False), LanguageModule({"model_type": "qwen3"}), "fit")
