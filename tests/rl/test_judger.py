"""Judgers: the payload contract, batches, composed routing and merging, failures that cost one sample, built-ins."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from xtl.errors import ConfigError
from xtl.rl import (
    BaseJudger,
    ComposedJudger,
    ExactMatchJudger,
    FormatJudger,
    FunctionJudger,
    Judger,
    MathJudger,
    RegexJudger,
    RolloutState,
    SyncJudger,
)
from xtl.rl.judger import FAILED


def _states(*pairs: tuple[str, str], source: str = "default") -> list[RolloutState]:
    return [RolloutState(response=r, ground_truth=g, data_source=source) for r, g in pairs]


class Recording(Judger):
    """Scores the response's length; records the payloads and batch sizes it was given."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.batches: list[list[dict]] = []

    def preprocess(self, state: RolloutState) -> dict:
        return {"text": state.response}  # only what the score needs

    async def judge_payload(self, payloads: list[dict]) -> list[dict]:
        self.batches.append(payloads)
        return [{"score": float(len(p["text"]))} for p in payloads]


def _score(response: str, ground_truth, bonus: float = 0.0) -> float:
    """A module-level function for FunctionJudger's import path."""
    return float(response == ground_truth) + bonus


class TestContract:
    def test_single_and_batch(self):
        judger = Recording(batch_size=2)
        (one,) = judger.judge_sync(_states(("abc", None)))
        assert one.reward == {"score": 3.0} and one.status == "completed"
        states = judger.judge_sync(_states(("a", None), ("bb", None), ("ccc", None)))
        assert [s.reward["score"] for s in states] == [1.0, 2.0, 3.0]
        assert [len(b) for b in judger.batches[1:]] == [2, 1]
        assert judger.batches[1][0] == {"text": "a"}, "the payload holds what preprocess took, not the state"

    def test_a_hung_judger_fails_its_sample_only(self):
        class Hangs(SyncJudger):
            def score(self, payload):
                if payload["response"] == "hang":
                    time.sleep(2.0)
                return 1.0

        started = time.perf_counter()
        states = Hangs(timeout_s=0.3).judge_sync(_states(("ok", None), ("hang", None), ("fine", None)))
        assert time.perf_counter() - started < 1.5
        assert [s.status for s in states] == ["completed", FAILED, "completed"]
        assert states[1].reward is None and "did not answer within 0.3 s" in states[1].error
        assert states[0].reward == states[2].reward == {"score": 1.0}

    def test_a_crashing_judger_fails_its_sample_only(self):
        def crash(response, ground_truth):
            if response == "boom":
                raise RuntimeError("scorer broke")
            return 0.5

        states = FunctionJudger(crash).judge_sync(_states(("boom", None), ("fine", None)))
        assert states[0].status == FAILED and states[0].error == "RuntimeError: scorer broke"
        assert states[1].reward == {"score": 0.5}

    def test_a_wrong_number_of_outputs_fails_the_batch(self):
        class Short(Judger):
            async def judge_payload(self, payloads):
                return [{"score": 1.0}]

        states = Short(batch_size=2).judge_sync(_states(("a", None), ("b", None)))
        assert all(s.status == FAILED and "returned 1 outputs for 2 payloads" in s.error for s in states)

    @pytest.mark.parametrize(("kwargs", "message"), [({"timeout_s": 0}, "timeout_s"), ({"batch_size": 0}, "batch")])
    def test_bad_settings(self, kwargs, message):
        with pytest.raises(ConfigError, match=message):
            Recording(**kwargs)


class OwnFlow(BaseJudger):
    async def batch_judge(self, states):
        for state in states:
            state.reward = {"score": 9.0}
        return list(states)


class TestComposed:
    def test_routes_by_data_source(self):
        math, length = MathJudger(), Recording()
        composed = ComposedJudger({"math": math, "*": length})
        states = [
            RolloutState("The answer is \\boxed{\\frac{1}{2}}", "0.5", "math"),
            RolloutState("hello", None, "chat"),
        ]
        composed.judge_sync(states)
        assert states[0].reward == {"score": 1.0} and states[1].reward == {"score": 5.0}
        assert length.batches == [[{"text": "hello"}]], "the math state never reached the other branch"

    def test_several_branches_merge(self):
        composed = ComposedJudger({"math": [MathJudger(), FormatJudger(r".*\\boxed\{.*\}.*", reward=0.2)]})
        (state,) = composed.judge_sync([RolloutState("so \\boxed{4}", "4", "math")])
        assert state.reward == {"score": 1.2, "MathJudger/score": 1.0, "FormatJudger/score": 0.2}
        custom = ComposedJudger(
            {"math": [MathJudger(), FormatJudger(r"\\boxed\{.*\}")]},
            merge_fn=lambda outputs, judgers: {"score": min(o["score"] for o in outputs)},
        )
        (state,) = custom.judge_sync([RolloutState("so \\boxed{4}", "4", "math")])
        assert state.reward == {"score": 0.0}

    def test_one_failing_branch_fails_the_state_not_the_others(self):
        class Hangs(Judger):
            async def judge_payload(self, payloads):
                await asyncio.sleep(5)

        composed = ComposedJudger({"slow": [Hangs(timeout_s=0.2), Recording()], "*": Recording()})
        states = composed.judge_sync([RolloutState("x", None, "slow"), RolloutState("yy", None, "other")])
        assert states[0].status == FAILED and states[0].reward is None
        assert states[1].reward == {"score": 2.0}

    def test_a_judger_owning_its_flow_is_refused_as_a_branch(self):
        assert OwnFlow().judge_sync(_states(("x", None)))[0].reward == {"score": 9.0}  # fine on its own
        with pytest.raises(ConfigError, match="branch of 'math' is a OwnFlow.*subclass xtl.rl.Judger"):
            ComposedJudger({"math": OwnFlow()})
        with pytest.raises(ConfigError, match="has no judger"):
            ComposedJudger({"math": []})

    def test_an_unrouted_source_names_the_branches(self):
        with pytest.raises(ConfigError, match=r"no branch for data_source 'code' \(branches: \['math'\]\)"):
            ComposedJudger({"math": MathJudger()}).judge_sync([RolloutState("x", None, "code")])


class TestBuiltins:
    @pytest.mark.parametrize(
        ("response", "truth", "score"),
        [
            ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
            ("2 + 3 = 5", "5", 1.0),
            ("82", "82", 1.0),
            ("3745", "82", 0.0),
            ("I do not know.", "82", 0.0),
            ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
        ],
    )
    def test_math(self, response, truth, score):
        assert MathJudger().judge_sync(_states((response, truth)))[0].reward == {"score": score}

    def test_math_judging_runs_off_the_main_thread(self):
        seen = []

        class Where(MathJudger):
            def score(self, payload):
                seen.append(threading.current_thread() is threading.main_thread())
                return super().score(payload)

        assert Where().judge_sync(_states(("5", "5")))[0].reward == {"score": 1.0}
        assert seen == [False]

    def test_exact_regex_format_function(self):
        assert ExactMatchJudger().judge_sync(_states((" 82\n", "82"), ("82.", "82")))[1].reward == {"score": 0.0}
        assert ExactMatchJudger(ignore_case=True).judge_sync(_states(("ABC", "abc")))[0].reward == {"score": 1.0}
        regex = RegexJudger(r"answer: (\d+)")
        states = regex.judge_sync(_states(("answer: 1, no, answer: 82", "82"), ("82", "82")))
        assert [s.reward["score"] for s in states] == [1.0, 0.0]  # the last match; none
        fmt = FormatJudger(r"<think>.*</think>\s*\S.*", reward=0.5)
        states = fmt.judge_sync(_states(("<think>\nhm\n</think>\n82", None), ("82", None)))
        assert [s.reward["score"] for s in states] == [0.5, 0.0]
        function = FunctionJudger("tests.rl.test_judger:_score")
        state = RolloutState("82", "82", extra={"bonus": 0.25})
        assert function.judge_sync([state])[0].reward == {"score": 1.25}

    @pytest.mark.parametrize(
        ("build", "message"),
        [
            (lambda: RegexJudger("(unclosed"), "not a regular expression"),
            (lambda: FunctionJudger("tests.rl.test_judger:missing"), "cannot import 'tests.rl.test_judger:missing'"),
            (lambda: FunctionJudger("tests.rl.test_judger:OwnFlow.judge"), "cannot import"),
        ],
    )
    def test_bad_settings(self, build, message):
        with pytest.raises(ConfigError, match=message):
            build()


class TestJudgeSyncInsideALoop:
    def test_a_running_event_loop_in_the_thread_does_not_stop_judging(self) -> None:
        import asyncio

        from xtl.rl import ExactMatchJudger, RolloutState

        async def inside() -> list:
            return ExactMatchJudger().judge_sync([RolloutState("4", "4"), RolloutState("5", "4")])

        judged = asyncio.run(inside())  # as in a notebook, where the kernel's loop runs
        assert [s.reward["score"] for s in judged] == [1.0, 0.0]
