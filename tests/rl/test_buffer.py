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
    vision = None  # text prompts

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
        metrics = stats.metrics()
        assert metrics["rollout/reward_mean"] == 0.5, "the trained groups"
        assert metrics["rollout/sampled_reward_mean"] == 4 / 16, "every judged sample, filtered groups included"

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


class StreamEngine(RolloutEngine):
    """Row ``k``'s completion is ``lengths[k]`` tokens ``100 * k + i``, then the stop token; each call continues a
    prompt ``[k, *tokens so far]`` by at most ``max_new_tokens`` tokens. A token's log-probability is
    ``-version - i / 1000``: which weights sampled it, and where."""

    def __init__(self, lengths: dict[int, int]) -> None:
        self.lengths = lengths
        self.version = 0

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings, stop_token_ids=()):
        out = []
        for prompt in prompts:
            k, done = prompt[0], len(prompt) - 1
            whole = [100 * k + i for i in range(self.lengths[k])] + [STOP]
            ids = whole[done : done + sampling.max_new_tokens]
            logprobs = [-self.version - (done + i) / 1000 for i in range(len(ids))]
            out.append(Rollout(list(prompt), ids, "stop" if ids[-1] == STOP else "length", logprobs))
        return out


class TestPartialRollouts:
    def _batch(self, engine, buffer, rows, version, **kwargs):
        return produce_batch(
            1, lambda n: [next(rows) for _ in range(n)], SingleTurnLoop(), AgentContext(IndexChat()), engine,
            FunctionJudger(_reward), SamplingSettings(group_size=2, max_new_tokens=kwargs.pop("budget", 16)), buffer,
            version, partial_tokens=4, **kwargs,
        )  # fmt: skip

    def test_a_long_completion_pauses_and_continues_under_newer_weights_keeping_its_tokens(self) -> None:
        """Row 1 (10 tokens) pauses twice at 4-token rounds and finishes in the third batch: its tokens are the
        whole completion, each with the log-probability of the weights that sampled it; row 0 finishes at once."""
        engine, buffer, rows = StreamEngine({0: 10, 1: 3, 2: 3, 3: 3}), ReplayBuffer(max_staleness=4), iter(_rows(4))
        groups, stats = self._batch(engine, buffer, rows, version=0)
        assert groups == [] and stats.partial_groups == 1 and stats.states[SampleState.ABORTED] == 2
        assert all(s.paused and s.finish_reason == "abort" for s in buffer.partial[0].samples)
        engine.version = 1
        groups, stats = self._batch(engine, buffer, rows, version=1)
        assert [g.row["index"] for g in groups] == [1] and stats.resumed == 2 and stats.partial_groups == 1
        engine.version = 2
        groups, stats = self._batch(engine, buffer, rows, version=2)
        (group,) = groups
        assert group.row["index"] == 0 and (group.started, group.version) == (0, 2) and stats.resumed == 2
        for sample in group.samples:
            assert sample.response_ids == [*range(10), STOP] and sample.state == SampleState.COMPLETED
            assert sample.finish_reason == "stop" and sample.resumes == 2 and sample.reward is not None
            assert [round(-lp) for lp in sample.logprobs] == [0] * 4 + [1] * 4 + [2] * 3
            assert sample.logprobs[5] == pytest.approx(-1.005), "continued where it paused"
        assert stats.staleness == [2, 2], "counted from the weights that began it"
        assert stats.metrics()["rollout/resumed"] == 2.0

    def test_a_completion_paused_too_often_expires_and_one_past_the_budget_is_cut(self) -> None:
        engine, rows = StreamEngine({0: 50, 1: 5}), iter(_rows(2))
        buffer = ReplayBuffer(max_staleness=4)
        self._batch(engine, buffer, rows, version=0, max_resumes=1)
        groups, stats = self._batch(engine, buffer, rows, version=1, max_resumes=1)
        assert stats.states[SampleState.EXPIRED] == 2 and stats.resumed == 2 and not buffer.partial
        expired = [g for g in groups if g.row["index"] == 0]
        assert expired and all(s.state == SampleState.EXPIRED for s in expired[0].samples)
        assert expired[0].rewards == [], "an expired completion is not judged"
        rows, buffer = iter(_rows(2)), ReplayBuffer()
        self._batch(engine, buffer, rows, version=0, budget=6)
        groups, _ = self._batch(engine, buffer, rows, version=1, budget=6)
        cut = [g for g in groups if g.row["index"] == 0][0].samples[0]
        assert cut.response_ids == list(range(6)) and cut.finish_reason == "length" and len(cut.logprobs) == 6

    def test_paused_groups_are_checkpointed(self) -> None:
        engine, buffer = StreamEngine({0: 10}), ReplayBuffer()
        self._batch(engine, buffer, iter(_rows(1)), version=0)
        restored = ReplayBuffer()
        restored.load_state_dict(buffer.state_dict())
        assert restored.partial == buffer.partial and restored.partial[0].samples[0].paused
