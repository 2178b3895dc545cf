"""The environment loop: gymnasium's reset/step contract on text, observations as masked user turns, the summed
step rewards standing in for the judger, and a failing environment costing its own trajectory."""

from __future__ import annotations

import pytest

from tests.rl.agent.scripted import ScriptedEngine, tiny_chat
from xtl.errors import ConfigError
from xtl.rl import FunctionJudger, SamplingSettings
from xtl.rl.agent import AgentContext, EnvironmentLoop
from xtl.rl.buffer import ReplayBuffer, SampleState, produce_batch

QUESTION = "Guess my number"


class GuessingGame:
    """Guess a number from 1 to 9: ``higher`` / ``lower`` hints, reward 1 when found, -0.1 per wrong guess."""

    def __init__(self, limit: int = 3, fail_at: str | None = None) -> None:
        self.limit, self.fail_at = limit, fail_at

    def reset(self, seed=None, options=None):
        self.target, self.guesses = int(options["row"]["answer"]), 0
        if self.fail_at == "reset":
            raise RuntimeError("no game today")
        return "I picked a number from 1 to 9.", {}

    def step(self, action: str):
        if self.fail_at == "step":
            raise ValueError(f"cannot read {action!r}")
        self.guesses += 1
        guess = int(action.strip())
        if guess == self.target:
            return "Right!", 1.0, True, False, {}
        return ("higher" if guess < self.target else "lower"), -0.1, False, self.guesses >= self.limit, {}


def _run(guesses: list[str], **game) -> tuple:
    chat = tiny_chat()
    engine = ScriptedEngine(chat, {QUESTION: guesses})
    loop = EnvironmentLoop(GuessingGame, game)
    rows = [{"prompt": [{"role": "user", "content": QUESTION}], "answer": "5"}]
    return chat, loop.rollout(rows, engine, SamplingSettings(), AgentContext(chat))[0]


class TestEnvironmentLoop:
    def test_observations_are_masked_turns_and_rewards_add_up(self) -> None:
        chat, trajectory = _run(["3", "7", "5"])
        assert trajectory.finish_reason == "stop" and trajectory.reward == pytest.approx(0.8)
        assert [t.kind for t in trajectory.turns] == ["assistant", "environment"] * 2 + ["assistant"]
        segment = trajectory.segments[0]
        hint = trajectory.turns[1]
        assert chat.tokenizer.decode(segment.response_ids[hint.start : hint.end]).startswith(
            "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
        )
        assert set(segment.loss_mask[hint.start : hint.end]) == {0}
        assert [m["content"] for m in trajectory.messages] == [
            QUESTION, "I picked a number from 1 to 9.", "3", "higher", "7", "lower", "5",
        ]  # fmt: skip
        assert chat.prompt_ids(trajectory.messages[:2]) == segment.prompt_ids  # the first observation is prompt

    def test_truncation_ends_with_length(self) -> None:
        _, trajectory = _run(["1"], limit=2)
        assert trajectory.finish_reason == "length" and trajectory.stats["turns"] == 2
        assert trajectory.reward == pytest.approx(-0.2)

    @pytest.mark.parametrize("where", ["reset", "step"])
    def test_a_failing_environment_aborts_its_trajectory(self, where: str) -> None:
        _, trajectory = _run(["3"], fail_at=where)
        assert trajectory.finish_reason == "abort" and trajectory.reward is None
        assert trajectory.error.startswith(f"{where} raised")

    def test_the_return_stands_in_for_the_judger_and_failures_are_aborted_samples(self) -> None:
        def judge(response: str, ground_truth: str) -> float:
            raise AssertionError("an environment's return is the reward: the judger is not asked")

        chat = tiny_chat()
        rows = [{"prompt": [{"role": "user", "content": QUESTION}], "answer": "5", "data_source": "d"}]
        groups, stats = produce_batch(
            1, lambda n: rows * n, EnvironmentLoop(GuessingGame), AgentContext(chat),
            ScriptedEngine(chat, {QUESTION: ["3", "5"]}), FunctionJudger(judge), SamplingSettings(group_size=2),
            ReplayBuffer(), 0,
        )  # fmt: skip
        assert [s.reward for s in groups[0].samples] == [pytest.approx(0.9)] * 2
        assert [s.state for s in groups[0].samples] == [SampleState.COMPLETED] * 2
        assert stats.metrics()["rollout/turns"] == 2.0 and groups[0].samples[0].loss_mask.count(0) > 0

    def test_an_environment_that_cannot_be_imported_is_refused(self) -> None:
        with pytest.raises(ConfigError, match="agent.init_args.environment: cannot import 'nowhere.Env'"):
            EnvironmentLoop("nowhere.Env")
