"""The replay buffer and the batch producer, with a scripted rollout engine (no model)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from xtl.rl import FunctionJudger, Rollout, RolloutEngine, SamplingSettings
from xtl.rl.agent import AgentContext, SingleTurnLoop
from xtl.rl.buffer import Group, ProduceStats, ReplayBuffer, Sample, SampleState, produce_batch

STOP = 99


class ScriptedEngine(RolloutEngine):
    """Answers prompt ``[k]`` with ``[k, i % modulo]`` (+ a stop token unless ``cut``) for its ``i``-th call."""

    def __init__(self, modulo: dict[int, int], cut: set[int] = frozenset()) -> None:
        self.modulo = modulo
        self.cut = cut
        self.calls = 0

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings, stop_token_ids=()):
        out = []
        for prompt in prompts:
            k = prompt[0]
            tail = [] if k in self.cut else [STOP]
            out.append(
                Rollout(list(prompt), [k, self.calls % self.modulo.get(k, 1), *tail], "stop" if tail else "length")
            )
            self.calls += 1
        return out


def _rows(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": str(k)}], "answer": "1", "data_source": "d", "index": k}
            for k in range(n)]  # fmt: skip


class IndexChat:
    """A chat format whose prompt of a row is ``[index]`` and whose answer is the last token before the stop."""

    stop_token_ids = (STOP,)

    def prompt_ids(self, messages, tools=None):
        return [int(messages[-1]["content"])]

    def answer(self, ids):
        return str([t for t in ids if t != STOP][-1])


def _produce(engine, judger, buffer, num_groups=2, version=0, **kwargs):
    rows = iter(_rows(100))
    return produce_batch(
        num_groups,
        lambda n: [next(rows) for _ in range(n)],
        SingleTurnLoop(),
        AgentContext(IndexChat()),
        engine,
        judger,
        SamplingSettings(group_size=4),
        buffer,
        version,
        **kwargs,
    )


def _reward(response: str, ground_truth: str) -> float:
    return float(response == ground_truth)


class TestProduceBatch:
    def test_groups_are_judged_and_counted(self) -> None:
        groups, stats = _produce(ScriptedEngine({0: 2, 1: 2}), FunctionJudger(_reward), ReplayBuffer())
        assert [g.row["index"] for g in groups] == [0, 1]
        assert [s.reward for s in groups[0].samples] == [0.0, 1.0, 0.0, 1.0]  # responses "0", "1", "0", "1"
        metrics = stats.metrics()
        assert metrics["rollout/samples"] == 8 and metrics["rollout/tokens"] == 8 * 3
        assert metrics["rollout/reward_sum"] == 4 and metrics["rollout/reward_count"] == 8
        assert metrics["rollout/completed"] == 8 and metrics["rollout/rounds"] == 1
        assert metrics["rollout/gen_seconds_max"] >= metrics["rollout/gen_seconds_p50"] >= 0

    def test_dynamic_sampling_filters_groups_without_signal_and_refills(self) -> None:
        # prompts 0 and 2 always answer "0" (every reward 0): filtered; 1 and 3 vary
        engine = ScriptedEngine({1: 2, 3: 2})
        groups, stats = _produce(engine, FunctionJudger(_reward), ReplayBuffer(), dynamic_sampling=True, max_rounds=3)
        assert [g.row["index"] for g in groups] == [1, 3] and all(g.has_signal for g in groups)
        assert stats.states[SampleState.FILTERED] == 8 and stats.rounds == 3  # 0+1, then 2, then 3

    def test_without_dynamic_sampling_such_groups_train(self) -> None:
        groups, stats = _produce(ScriptedEngine({1: 2}), FunctionJudger(_reward), ReplayBuffer())
        assert [g.row["index"] for g in groups] == [0, 1] and stats.states[SampleState.FILTERED] == 0

    def test_max_rounds_bounds_the_refills(self) -> None:
        groups, stats = _produce(ScriptedEngine({}), FunctionJudger(_reward), ReplayBuffer(), dynamic_sampling=True,
                                 max_rounds=2)  # fmt: skip
        assert groups == [] and stats.rounds == 2 and stats.states[SampleState.FILTERED] == 4 * 4

    def test_oversampled_groups_wait_in_the_buffer_and_expire_when_stale(self) -> None:
        buffer = ReplayBuffer(max_staleness=1)
        engine = ScriptedEngine({k: 2 for k in range(10)})
        groups, stats = _produce(engine, FunctionJudger(_reward), buffer, oversample=2.0)
        assert len(groups) == 2 and len(buffer.groups) == 2 and stats.leftover_groups == 2
        again, _ = _produce(engine, FunctionJudger(_reward), buffer, version=1)
        assert [g.row["index"] for g in again] == [2, 3], "the leftovers train first"
        _produce(engine, FunctionJudger(_reward), buffer, oversample=2.0, version=2)
        _, stats = _produce(engine, FunctionJudger(_reward), buffer, num_groups=1, version=5)
        assert stats.states[SampleState.EXPIRED] == 2 * 4 and buffer.groups == [], "version 2's leftovers at 5"

    def test_a_hung_or_crashing_judger_fails_its_sample_only(self) -> None:
        calls = []

        def judge(response: str, ground_truth: str) -> float:
            calls.append(response)
            if len(calls) == 2:
                raise RuntimeError("judge crashed")
            if len(calls) == 3:
                import time

                time.sleep(3)  # hangs past the time-out
            return 1.0

        judger = FunctionJudger(judge, timeout_s=0.5)
        groups, stats = _produce(ScriptedEngine({0: 2, 1: 2}), judger, ReplayBuffer())
        states = [s.state for g in groups for s in g.samples]
        assert states.count(SampleState.FAILED) == 2 and states.count(SampleState.COMPLETED) == 6
        failed = [s for g in groups for s in g.samples if s.state == SampleState.FAILED]
        assert {s.reward for s in failed} == {None} and any("crashed" in (s.error or "") for s in failed)
        assert stats.reward_count == 6

    def test_aborted_and_cut_samples_are_accounted(self) -> None:
        groups, stats = _produce(ScriptedEngine({0: 2, 1: 2}, cut={1}), FunctionJudger(_reward), ReplayBuffer())
        assert stats.truncated == 4 and groups[1].samples[0].finish_reason == "length"


class TestReplayBuffer:
    def test_state_round_trip(self) -> None:
        buffer = ReplayBuffer(max_staleness=2)
        sample = Sample([1, 2], [3, STOP], "stop", reward=0.5, response="3")
        buffer.put([Group(_rows(1)[0], [sample, Sample([1, 2], [4], "length", state=SampleState.FAILED)], 7)])
        restored = ReplayBuffer(max_staleness=2)
        restored.load_state_dict(buffer.state_dict())
        assert restored.groups == buffer.groups

    def test_percentiles(self) -> None:
        stats = ProduceStats(generation_seconds=[4.0, 1.0, 2.0, 3.0, 5.0])
        metrics = stats.metrics()
        assert metrics["rollout/gen_seconds_p50"] == 3.0 and metrics["rollout/gen_seconds_max"] == 5.0
        assert metrics["rollout/gen_seconds_p90"] == pytest.approx(4.6)


class TestRanksAgree:
    def test_a_rank_with_enough_groups_still_draws_and_generates_what_another_rank_misses(self) -> None:
        """Rank view: this rank's groups all have signal, another rank's do not (it misses 2 groups in round 2): both
        draw 2 prompts and generate in round 2, so draws and decoding forwards stay in step; the surplus waits."""
        engine, buffer = ScriptedEngine({k: 2 for k in range(10)}), ReplayBuffer()
        others = iter([2, 2, 0])  # what the other rank misses, round by round
        groups, stats = _produce(engine, FunctionJudger(_reward), buffer, dynamic_sampling=True, max_rounds=3,
                                 agree=lambda n: max(n, next(others)))  # fmt: skip
        assert len(groups) == 2 and stats.rounds == 2 and [g.row["index"] for g in buffer.groups] == [2, 3]
