"""The replay buffer: rollout groups, their states, and the accounting of each produced batch.

A prompt's ``group_size`` completions form a :class:`Group`. Each sample is in one :class:`SampleState`:

- ``completed``: generated and judged; it can train;
- ``failed``: its judging raised or timed out (its reward is unknown: the group's advantages leave it out; the
  batch's :class:`ProduceStats` counts the errors, which :mod:`xtl.rl.failures` says on the console);
- ``filtered``: dynamic sampling dropped its group (every reward equal: no learning signal);
- ``aborted``: its generation was cut off by the producer (the engine stopped it; with partial rollouts, a
  completion paused at the end of a round, continued in a later one), or its agent crashed or timed out (an agent
  loop's trajectory that finished with ``abort``);
- ``expired``: it waited in the buffer longer than ``max_staleness`` policy versions, or was paused more than
  ``max_resumes`` times.

With partial rollouts (``partial_tokens``), each engine call samples at most ``partial_tokens`` tokens of a
completion: a group whose completions are not all finished waits in the buffer (its samples keep their tokens and
the engine's log-probabilities of them) and is continued first by the next batch, with the weights of that time.

A sample of a prompt with images (a vision-language policy) keeps the paths of its prompt's images (``images``): its
turns, its continuations and its updates all read them.

:func:`produce_batch` collects ``num_groups`` trainable groups: leftovers from earlier rounds first (when still fresh
enough), then new prompts, generated, judged and (with dynamic sampling) filtered, round after round until enough
groups are in or ``max_rounds`` is spent. Groups beyond ``num_groups`` stay in the buffer for the next batch. Each
round's completions come from the run's agent loop (:mod:`xtl.rl.agent`): one completion per prompt by default,
multi-turn trajectories with tools, environments or black-box agents otherwise; a trajectory's environment reward,
when it has one, stands in for the judger's.
:class:`ProduceStats` is what the round cost and left over, logged as ``rollout/...`` metrics.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any

from xtl.rl import trace
from xtl.rl.agent.loop import AgentContext, AgentLoop, lockstep_generate
from xtl.rl.agent.trajectory import Segment, Trajectory
from xtl.rl.judger import BaseJudger, RolloutState
from xtl.rl.rollout import RolloutEngine, SamplingSettings
from xtl.rl.vision import PromptImages

# an agent loop's per-trajectory counters, logged per sample as rollout/<name>
AGENT_COUNTERS = (
    "turns", "tool_calls", "tool_errors", "tool_timeouts", "malformed_calls", "refused_calls", "segments",
)  # fmt: skip


class SampleState(str, Enum):
    """Where a sample stands (see the module docstring)."""

    COMPLETED = "completed"
    FAILED = "failed"
    FILTERED = "filtered"
    ABORTED = "aborted"
    EXPIRED = "expired"


@dataclass
class Sample:
    """One completion of a prompt, judged.

    Attributes:
        prompt_ids: The prompt's token ids.
        response_ids: The completion's token ids.
        finish_reason: ``stop``, ``length`` or ``abort``.
        reward: The judged score (``None`` when judging failed).
        state: Its :class:`SampleState`.
        response: The decoded completion.
        error: Why judging failed (or why its agent aborted).
        logprobs: The engine's log-probability of each completion token (``None`` when it gives none).
        loss_mask: 1 on the completion tokens the engine sampled, 0 on the ones an agent loop appended (tool
            results, observations); ``None``: every token was sampled.
        earlier: A multi-segment trajectory's earlier segments (each trains as its own sequence).
        messages: An agent loop's conversation (judgers read it as ``RolloutState.messages``).
        stats: An agent loop's counters (turns, tool calls and their errors).
        paused: A partial rollout cut at the end of a round, to be continued (its state is ``aborted`` meanwhile).
        resumes: How many times it was continued under newer weights.
        uid: Its id in the rollout trace (``<train step>.<round>.<group>.<completion>`` of the batch that began it).
        images: The paths of its prompt's images (``None``: a text prompt).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: str
    reward: float | None = None
    state: SampleState = SampleState.COMPLETED
    response: str = ""
    error: str | None = None
    logprobs: list[float] | None = None
    loss_mask: list[int] | None = None
    earlier: list[Segment] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    stats: dict[str, int] = field(default_factory=dict)
    paused: bool = False
    resumes: int = 0
    uid: str = ""
    images: list[str] | None = None

    @property
    def segments(self) -> list[Segment]:
        """What trains: the earlier segments and the last one (prompt, completion, mask, log-probabilities)."""
        mask = self.loss_mask if self.loss_mask is not None else [1] * len(self.response_ids)
        return [*self.earlier, Segment(self.prompt_ids, self.response_ids, mask, self.logprobs)]


@dataclass
class Group:
    """The completions of one prompt.

    Attributes:
        row: The prompt's row (``prompt``, ``answer``, ``data_source``, ``index``).
        samples: Its completions.
        version: The policy version (rollout batches trained) that last sampled it.
        started: The policy version that began it (``None``: ``version``; earlier when partial rollouts continued it).
    """

    row: dict[str, Any]
    samples: list[Sample]
    version: int
    started: int | None = None

    @property
    def first_version(self) -> int:
        """The policy version that began it."""
        return self.version if self.started is None else self.started

    @property
    def paused(self) -> bool:
        """Whether a completion is paused (partial rollouts): the group waits to be continued."""
        return any(s.paused for s in self.samples)

    @property
    def rewards(self) -> list[float]:
        """The rewards of the samples that were judged."""
        return [s.reward for s in self.samples if s.reward is not None]

    @property
    def has_signal(self) -> bool:
        """Whether at least two judged rewards differ (else every advantage is 0)."""
        rewards = self.rewards
        return len(rewards) >= 2 and max(rewards) != min(rewards)

    def mark(self, state: SampleState) -> None:
        """Move every sample that was completed to ``state``."""
        for sample in self.samples:
            if sample.state == SampleState.COMPLETED:
                sample.state = state


@dataclass
class ProduceStats:
    """What producing one training batch took and left over.

    Attributes:
        generation_seconds: Wall time of each generation call.
        states: Samples per final state, over every group this batch touched (trained, filtered, left over).
        reward_sum: Sum of the judged rewards of the trained groups.
        reward_count: Judged samples of the trained groups.
        judged_sum: Sum of the rewards of every sample judged for this batch (before dynamic sampling drops groups:
            the policy's reward on what it sampled).
        judged_count: Samples judged for this batch.
        samples: Samples generated for this batch.
        tokens: Completion tokens generated for this batch.
        rounds: Generation rounds.
        leftover_groups: Groups kept in the buffer for the next batch.
        truncated: Completions cut at ``max_new_tokens`` (or an agent loop's budget) among the trained ones.
        agent: An agent loop's counters summed over the samples generated (turns, tool calls and their errors,
            segments).
        pause_seconds: How long production waited for the weights it samples with (asynchronous rollouts).
        resumed: Paused completions continued for this batch (partial rollouts).
        partial_groups: Groups left waiting with paused completions (partial rollouts).
        staleness: Per trained sample, how many versions the policy that began it lags the one it trains.
        judge_sent: Samples sent to the judger for this batch (an environment's return stands in for it on others).
        judge_errors: Why the judging of this batch's failed samples failed (``state.error``: a judger's exception
            or time-out) -> how many samples (:mod:`xtl.rl.failures` says them on the console).
        version: The policy version that sampled this batch.
        expired_groups: Leftover groups that expired while this batch was produced (for the trace).
    """

    generation_seconds: list[float] = field(default_factory=list)
    states: Counter = field(default_factory=Counter)
    reward_sum: float = 0.0
    reward_count: int = 0
    judged_sum: float = 0.0
    judged_count: int = 0
    samples: int = 0
    tokens: int = 0
    rounds: int = 0
    leftover_groups: int = 0
    truncated: int = 0
    agent: Counter = field(default_factory=Counter)
    pause_seconds: float = 0.0
    resumed: int = 0
    partial_groups: int = 0
    staleness: list[int] = field(default_factory=list)
    judge_sent: int = 0
    judge_errors: dict[str, int] = field(default_factory=dict)
    version: int = 0
    expired_groups: list[Group] = field(default_factory=list, repr=False)

    def metrics(self) -> dict[str, float]:
        """``rollout/...`` metrics: generation time percentiles, samples by state, rewards, samples and tokens."""
        times = sorted(self.generation_seconds) or [0.0]
        out = {
            "rollout/gen_seconds_p50": _percentile(times, 50),
            "rollout/gen_seconds_p90": _percentile(times, 90),
            "rollout/gen_seconds_max": times[-1],
            "rollout/reward_sum": self.reward_sum,
            "rollout/reward_count": float(self.reward_count),
            "rollout/reward_mean": self.reward_sum / max(self.reward_count, 1),
            "rollout/sampled_reward_mean": self.judged_sum / max(self.judged_count, 1),
            "rollout/samples": float(self.samples),
            "rollout/tokens": float(self.tokens),
            "rollout/rounds": float(self.rounds),
            "rollout/leftover_groups": float(self.leftover_groups),
            "rollout/truncated": float(self.truncated),
            "rollout/pause_seconds": self.pause_seconds,
            "rollout/resumed": float(self.resumed),
            "rollout/partial_groups": float(self.partial_groups),
            "rollout/staleness_mean": sum(self.staleness) / max(len(self.staleness), 1),
            "rollout/staleness_max": float(max(self.staleness, default=0)),
            "rollout/version": float(self.version),
        }
        out.update({f"rollout/{state.value}": float(self.states.get(state, 0)) for state in SampleState})
        if self.agent:  # an agent loop's turns and tool calls, per sample
            out.update({f"rollout/{name}": self.agent.get(name, 0) / max(self.samples, 1) for name in AGENT_COUNTERS})
        return out


class ReplayBuffer:
    """Groups generated but not trained yet, and their ages.

    Args:
        max_staleness: A leftover group trains only while at most this many policy versions (rollout batches) older
            than the policy (older ones expire).
    """

    def __init__(self, max_staleness: int = 1) -> None:
        self.max_staleness = max_staleness
        self.groups: list[Group] = []
        self.partial: list[Group] = []  # groups with paused completions (partial rollouts)

    def take(self, count: int, version: int, stats: ProduceStats) -> list[Group]:
        """Up to ``count`` fresh leftover groups, oldest first; stale ones expire (counted in ``stats``)."""
        fresh, taken = [], []
        for group in self.groups:
            if version - group.version > self.max_staleness:
                group.mark(SampleState.EXPIRED)
                stats.states.update(s.state for s in group.samples)
                stats.expired_groups.append(group)
            else:
                fresh.append(group)
        taken, self.groups = fresh[:count], fresh[count:]
        return taken

    def put(self, groups: list[Group]) -> None:
        """Keep ``groups`` for a later batch."""
        self.groups.extend(groups)

    def state_dict(self) -> dict[str, Any]:
        """The groups, as plain data (checkpointable)."""
        return {
            "max_staleness": self.max_staleness,
            "groups": [group_dict(g) for g in self.groups],
            "partial": [group_dict(g) for g in self.partial],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.groups = [group_from(g) for g in state.get("groups", [])]
        self.partial = [group_from(g) for g in state.get("partial", [])]


def group_dict(group: Group) -> dict[str, Any]:
    """``group`` as plain data (checkpointable)."""
    samples = [_sample_dict(s) for s in group.samples]
    return {"row": group.row, "version": group.version, "started": group.started, "samples": samples}


def group_from(state: dict[str, Any]) -> Group:
    """Restore :func:`group_dict`."""
    return Group(state["row"], [_sample_from(s) for s in state["samples"]], state["version"], state.get("started"))


def produce_batch(
    num_groups: int,
    take_rows: Callable[[int], list[dict[str, Any]]],
    loop: AgentLoop,
    context: AgentContext,
    engine: RolloutEngine,
    judger: BaseJudger,
    sampling: SamplingSettings,
    buffer: ReplayBuffer,
    version: int,
    dynamic_sampling: bool = False,
    max_rounds: int = 1,
    reward_shaping: Callable[[list[Group]], None] | None = None,
    oversample: float = 1.0,
    agree: Callable[[int], int] | None = None,
    train_step: int | None = None,
    partial_tokens: int | None = None,
    max_resumes: int = 2,
) -> tuple[list[Group], ProduceStats]:
    """Collect ``num_groups`` trainable groups (see the module docstring).

    Args:
        num_groups: Groups wanted.
        take_rows: The next ``n`` prompt rows (every rank draws the same number per round).
        loop: Turns each row into a trajectory (:class:`~xtl.rl.agent.SingleTurnLoop`: one completion).
        context: The loop's chat format (prompts rendered, answers decoded, stop tokens) and the ranks' agreement.
        engine: Samples completions.
        judger: Scores them; a sample whose judging fails is ``failed``, not the batch.
        sampling: Group size and sampling settings.
        buffer: Leftover groups in, surplus groups out.
        version: The policy version (rollout batches trained) the engine samples with (recorded in each group).
        dynamic_sampling: Drop groups whose judged rewards are all equal (``filtered``) and draw more prompts.
        max_rounds: Generation rounds at most (with dynamic sampling, fewer groups than wanted may come back).
        reward_shaping: Adjusts the groups' rewards after judging (e.g. the overlong penalty), before filtering.
        oversample: Each round draws ``ceil(missing groups x oversample)`` prompts (above 1 with dynamic sampling,
            so that one round usually brings enough; the surplus waits in the buffer).
        agree: The most groups any data-parallel rank misses, given this rank's count (an all-reduce). Every rank then
            draws and generates the same number of prompts per round and runs the same rounds: prompt draws stay in
            step across ranks, and so do the forwards of decoding (sharded parameters need every rank in each).
        train_step: The policy version the batch trains (its index: a group's age is counted against it; default
            ``version``: the synchronous run, where the engine samples with the weights of that step).
        partial_tokens: Partial rollouts (single-turn loop): each engine call samples at most this many tokens of a
            completion; unfinished groups wait in the buffer and are continued first by the next batch (module
            docstring). ``None``: completions are sampled whole.
        max_resumes: A completion still unfinished after this many continuations expires.

    Returns:
        The groups to train on (at most ``num_groups``) and the accounting.
    """
    train_step = version if train_step is None else train_step
    with trace.current().span("produce_batch", "produce", step=train_step, version=version):
        return _produce(
            num_groups, take_rows, loop, context, engine, judger, sampling, buffer, version, dynamic_sampling,
            max_rounds, reward_shaping, oversample, agree, train_step, partial_tokens, max_resumes,
        )  # fmt: skip


# ---- private ---------------------------------------------------------------------------------------------------


def _produce(
    num_groups: int,
    take_rows: Callable[[int], list[dict[str, Any]]],
    loop: AgentLoop,
    context: AgentContext,
    engine: RolloutEngine,
    judger: BaseJudger,
    sampling: SamplingSettings,
    buffer: ReplayBuffer,
    version: int,
    dynamic_sampling: bool,
    max_rounds: int,
    reward_shaping: Callable[[list[Group]], None] | None,
    oversample: float,
    agree: Callable[[int], int] | None,
    train_step: int,
    partial_tokens: int | None,
    max_resumes: int,
) -> tuple[list[Group], ProduceStats]:
    """:func:`produce_batch`, inside its trace span."""
    tracer = trace.current()
    stats = ProduceStats(version=version)
    groups = buffer.take(num_groups, train_step, stats)
    waiting: list[Group] = []  # groups with paused completions, back to the buffer at the end

    def settle(fresh: list[Group]) -> None:
        """Judge, shape and filter the finished groups of ``fresh``; keep the others waiting."""
        finished = [g for g in fresh if not g.paused]
        waiting.extend(g for g in fresh if g.paused)
        _judge(finished, judger, train_step, stats)
        if reward_shaping is not None:
            reward_shaping(finished)
        for group in finished:
            stats.judged_sum += sum(group.rewards)
            stats.judged_count += len(group.rewards)
            if dynamic_sampling and not group.has_signal:
                group.mark(SampleState.FILTERED)
                stats.states.update(s.state for s in group.samples)
                ids = [s.uid for s in group.samples]
                status = {f"status.{uid}": SampleState.FILTERED.value for uid in ids}
                tracer.event("dynamic_sampling.filter", "filter", ids, train_step, filter_reason="equal rewards",
                             **status)  # fmt: skip
            else:
                groups.append(group)

    chunk = (
        None
        if partial_tokens is None
        else replace(sampling, max_new_tokens=min(partial_tokens, sampling.max_new_tokens))
    )
    if chunk is not None:  # every rank calls it (under sharded parameters, ranks without paused ones idle)
        resumed, buffer.partial = buffer.partial, []
        _continue(resumed, engine, chunk, sampling.max_new_tokens, context, version, max_resumes, stats, train_step)
        settle(resumed)
    for _ in range(max_rounds):
        missing = max(num_groups - len(groups), 0)
        missing = agree(missing) if agree is not None else missing
        if missing == 0:
            break
        stats.rounds += 1
        rows = take_rows(math.ceil(missing * oversample))
        fresh = _generate_groups(rows, loop, context, engine, chunk or sampling, version, stats, train_step)
        if chunk is not None:
            for group in fresh:
                for sample in group.samples:
                    _settle(sample, sample.finish_reason, sampling.max_new_tokens, context, max_resumes)
        settle(fresh)
    groups, surplus = groups[:num_groups], groups[num_groups:]
    buffer.put(surplus)
    buffer.partial.extend(waiting)
    stats.leftover_groups = len(buffer.groups)
    stats.partial_groups = len(buffer.partial)
    for group in waiting:
        stats.states.update(s.state for s in group.samples)
    for group in groups:
        stats.states.update(s.state for s in group.samples)
        stats.reward_sum += sum(group.rewards)
        stats.reward_count += len(group.rewards)
        stats.truncated += sum(s.finish_reason == "length" for s in group.samples)
        stats.staleness.extend(train_step - group.first_version for s in group.samples if s.state == "completed")
    _trace_states(tracer, train_step, [*groups, *waiting], stats.expired_groups)
    return groups, stats


def _trace_states(tracer: trace.Tracer, step: int, groups: list[Group], expired: list[Group]) -> None:
    """Each sample's final state in this batch (trained, paused or expired; filtered ones were traced as such)."""
    samples = [s for g in [*groups, *expired] for s in g.samples]
    if not samples:
        return
    states = {f"status.{s.uid}": s.state.value for s in samples}
    finish = {f"finish_reason.{s.uid}": s.finish_reason for s in samples}
    rewards = {f"reward.{s.uid}": s.reward for s in samples if s.reward is not None}
    tracer.event("produce_batch.states", "account", [s.uid for s in samples], step, **states, **finish, **rewards)


# ---- private ---------------------------------------------------------------------------------------------------


def _generate_groups(
    rows: list[dict[str, Any]],
    loop: AgentLoop,
    context: AgentContext,
    engine: RolloutEngine,
    sampling: SamplingSettings,
    version: int,
    stats: ProduceStats,
    step: int,
) -> list[Group]:
    size = sampling.group_size
    ids = [f"{step}.{stats.rounds}.{i}.{k}" for i in range(len(rows)) for k in range(size)]
    began = time.perf_counter()
    expanded = [row for row in rows for _ in range(size)]
    paths = [row.get("images") for row in expanded]
    with trace.current().span(f"{type(loop).__name__}.rollout", "agent_loop", ids, step):
        traced = replace(context, sample_ids=ids, images=_images(context, paths))
        trajectories = loop.rollout(expanded, engine, sampling, traced)
    stats.generation_seconds.append(time.perf_counter() - began)
    stats.samples += len(trajectories)
    stats.tokens += sum(t.sampled_tokens for t in trajectories)
    for trajectory in trajectories:
        stats.agent.update(trajectory.stats)
    samples = [_sample(t) for t in trajectories]
    for sample, uid, images in zip(samples, ids, paths, strict=True):
        sample.uid, sample.images = uid, None if not images else list(images)
    return [Group(row, samples[i * size : (i + 1) * size], version) for i, row in enumerate(rows)]


def _continue(
    groups: list[Group],
    engine: RolloutEngine,
    chunk: SamplingSettings,
    max_new_tokens: int,
    context: AgentContext,
    version: int,
    max_resumes: int,
    stats: ProduceStats,
    step: int,
) -> None:
    """Continue the paused completions of ``groups`` by one engine call of at most ``chunk.max_new_tokens`` tokens
    each, with the engine's current weights: their tokens and log-probabilities so far are kept."""
    paused = [s for g in groups for s in g.samples if s.paused]
    began = time.perf_counter()
    prompts = [s.prompt_ids + s.response_ids for s in paused]
    with trace.current().span("engine.generate", "generate", [s.uid for s in paused], step, resumed=len(paused)):
        resumed = replace(context, images=_images(context, [s.images for s in paused]))  # the prompt's images
        rollouts = lockstep_generate(engine, prompts, chunk, resumed)
    if not paused:
        return
    stats.generation_seconds.append(time.perf_counter() - began)
    stats.resumed += len(paused)
    stats.samples += len(paused)
    for sample, rollout in zip(paused, rollouts, strict=True):
        stats.tokens += len(rollout.response_ids)
        sample.response_ids = sample.response_ids + rollout.response_ids
        both = sample.logprobs is not None and rollout.logprobs is not None
        sample.logprobs = sample.logprobs + rollout.logprobs if both else None
        sample.resumes += 1
        _settle(sample, rollout.finish_reason, max_new_tokens, context, max_resumes)
    for group in groups:
        group.started, group.version = group.first_version, version


def _images(context: AgentContext, paths: list[list[str] | None]) -> list[PromptImages | None] | None:
    """The processed images of each prompt's ``paths`` (``None`` when no prompt has images)."""
    vision = context.chat.vision
    if vision is None or not any(paths):
        return None
    return [vision.images(p) for p in paths]


def _settle(sample: Sample, reason: str, max_new_tokens: int, context: AgentContext, max_resumes: int) -> None:
    """After a partial round: finished (a stop token, or the whole budget: cut to it), paused (``aborted`` until
    continued), or expired (paused more than ``max_resumes`` times)."""
    if reason == "length" and len(sample.response_ids) < max_new_tokens:
        sample.paused = sample.resumes < max_resumes
        sample.state, sample.finish_reason = (SampleState.ABORTED, "abort") if sample.paused else (
            SampleState.EXPIRED, "length")  # fmt: skip
        return
    if len(sample.response_ids) > max_new_tokens:
        sample.response_ids = sample.response_ids[:max_new_tokens]
        sample.logprobs = None if sample.logprobs is None else sample.logprobs[:max_new_tokens]
        reason = "length"
    sample.paused, sample.state, sample.finish_reason = False, SampleState.COMPLETED, reason
    sample.response = context.chat.answer(sample.response_ids)


def _sample(trajectory: Trajectory) -> Sample:
    last = trajectory.segments[-1]
    state = SampleState.ABORTED if trajectory.finish_reason == "abort" else SampleState.COMPLETED
    multi_turn = len(trajectory.turns) > 1 or len(trajectory.segments) > 1
    return Sample(
        last.prompt_ids, last.response_ids, trajectory.finish_reason, reward=trajectory.reward, state=state,
        response=trajectory.response, error=trajectory.error, logprobs=last.logprobs,
        loss_mask=None if all(last.loss_mask) else last.loss_mask, earlier=trajectory.segments[:-1],
        messages=trajectory.messages if multi_turn else None, stats=dict(trajectory.stats) if multi_turn else {},
    )  # fmt: skip


def _judge(groups: list[Group], judger: BaseJudger, step: int, stats: ProduceStats) -> None:
    """Score the completed samples that have no reward yet (an environment's return stands); count them and the
    failures' errors in ``stats``."""
    pending = [(g, s) for g in groups for s in g.samples if s.state == SampleState.COMPLETED and s.reward is None]
    if not pending:
        return
    with trace.current().span("judger.judge", "judge", [s.uid for _, s in pending], step) as span:
        _judge_pending(pending, judger, stats)
        span.set(**{f"reward.{s.uid}": s.reward for _, s in pending if s.reward is not None})


def _judge_pending(pending: list[tuple[Group, Sample]], judger: BaseJudger, stats: ProduceStats) -> None:
    states = [
        RolloutState(
            s.response, g.row.get("answer"), g.row.get("data_source", "default"), g.row.get("prompt"),
            messages=s.messages,
        )
        for g, s in pending
    ]  # fmt: skip
    stats.judge_sent += len(states)
    for (_, sample), state in zip(pending, judger.judge_sync(states), strict=True):
        if state.status == "failed" or state.reward is None:
            sample.state, sample.error = SampleState.FAILED, state.error
            reason = state.error or "the judger gave no reward"
            stats.judge_errors[reason] = stats.judge_errors.get(reason, 0) + 1
        else:
            sample.reward = float(state.reward["score"])


def _sample_dict(sample: Sample) -> dict[str, Any]:
    return {**asdict(sample), "state": sample.state.value}


def _sample_from(state: dict[str, Any]) -> Sample:
    earlier = [Segment(**segment) for segment in state.get("earlier", [])]
    return Sample(**{**state, "state": SampleState(state["state"]), "earlier": earlier})


def _percentile(values: list[float], q: float) -> float:
    position = (len(values) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return values[low] + (values[high] - values[low]) * (position - low)
