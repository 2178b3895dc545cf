"""Token-exact trajectories: what an agent loop returns and the trainer trains on.

A :class:`Trajectory` is one or more :class:`Segment` s. A segment is a prompt and everything after it in one
growing context: the tokens the engine sampled (loss mask 1, with their sampling log-probabilities) and the tokens
that came from elsewhere (tool results, environment observations, the template's wrappers around them, the next
generation prompt: loss mask 0). The sampled ids are kept as the engine returned them; nothing is decoded and
encoded again. A trajectory gets a second segment only when its context stops growing by appending (a black-box
agent that edits or truncates its history): each segment then trains as its own sequence, with the trajectory's
advantage. :class:`TrajectoryBuilder` assembles one turn by turn and records each :class:`Turn`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
TurnKind = Literal["assistant", "tool", "environment", "context"]


@dataclass
class Segment:
    """One growing context of a trajectory.

    Attributes:
        prompt_ids: The tokens before the first sampled one (never trained).
        response_ids: Every token after the prompt: sampled and appended ones.
        loss_mask: 1 on the sampled tokens, 0 on appended ones (``len(response_ids)`` entries).
        logprobs: The engine's log-probability of each sampled token, 0.0 on appended ones (``None`` when the
            engine gives none).
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None

    @property
    def context_ids(self) -> list[int]:
        """The prompt and the response so far (what the next generation continues)."""
        return [*self.prompt_ids, *self.response_ids]


@dataclass
class Turn:
    """One turn of a trajectory, located in its segment's response.

    Attributes:
        kind: ``assistant`` (sampled), ``tool`` (a tool result), ``environment`` (an observation), ``context``
            (other appended tokens, e.g. a black-box agent's own messages).
        segment: Index of its segment.
        start: First response position of the turn in that segment.
        end: One past its last response position.
        text: A short description (the tool's name and status, the observation's start).
        status: ``ok``, or for tool turns ``error``, ``timeout``, ``malformed`` or ``refused`` (over the limit).
    """

    kind: TurnKind
    segment: int
    start: int
    end: int
    text: str = ""
    status: str = "ok"


@dataclass
class Trajectory:
    """What an agent loop returns for one prompt: its segments, turns and final state.

    Attributes:
        segments: The growing contexts (usually one).
        turns: Every turn, in order.
        finish_reason: ``stop`` (the agent finished), ``length`` (a budget ran out: tokens, turns) or ``abort`` (the
            agent crashed or timed out: the sample does not train).
        response: The final answer text the judger scores.
        messages: The conversation as messages (the prompt's and every turn's), for judgers and inspection.
        reward: A reward the loop computed itself (an environment's return; ``None``: the judger scores).
        error: Why the trajectory aborted.
        notes: How it was rebuilt (a black-box agent's new segments, with the request that started each).
        stats: Counters of its turns: ``turns``, ``tool_calls``, ``tool_errors``, ``tool_timeouts``,
            ``malformed_calls``, ``refused_calls``.
        seconds: Wall time of the generation calls that produced it.
    """

    segments: list[Segment]
    turns: list[Turn] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    response: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def prompt_ids(self) -> list[int]:
        """The first segment's prompt."""
        return self.segments[0].prompt_ids

    @property
    def sampled_tokens(self) -> int:
        """Tokens the engine sampled, over every segment."""
        return sum(sum(s.loss_mask) for s in self.segments)


class TrajectoryBuilder:
    """Assembles a :class:`Trajectory` from a prompt, turn by turn.

    Args:
        prompt_ids: The first prompt.
        with_logprobs: Whether the engine gives log-probabilities (``False``: the segments carry none; ``None``:
            told by the first sampled turn).
    """

    def __init__(self, prompt_ids: list[int], with_logprobs: bool | None = None) -> None:
        self.with_logprobs = with_logprobs
        self.trajectory = Trajectory([self._segment(prompt_ids)])

    @property
    def segment(self) -> Segment:
        """The segment that grows."""
        return self.trajectory.segments[-1]

    @property
    def context_ids(self) -> list[int]:
        """What the next generation continues."""
        return self.segment.context_ids

    @property
    def response_tokens(self) -> int:
        """Response tokens of every segment (sampled and appended: a token budget counts them all)."""
        return sum(len(s.response_ids) for s in self.trajectory.segments)

    def sampled(self, ids: list[int], logprobs: list[float] | None = None, text: str = "") -> None:
        """Append tokens the engine sampled (trained on).

        Raises:
            ValueError: The engine gave log-probabilities for some turns and not others, or a wrong number.
        """
        if self.with_logprobs is None:
            self.with_logprobs = logprobs is not None
            for segment in self.trajectory.segments:
                segment.logprobs = [0.0] * len(segment.response_ids) if self.with_logprobs else None
        if (logprobs is not None) != self.with_logprobs:
            raise ValueError("an engine gives log-probabilities for every turn or for none")
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(logprobs)} log-probabilities for {len(ids)} sampled tokens")
        self._append("assistant", ids, 1, logprobs, text, "ok")

    def appended(self, ids: list[int], kind: TurnKind, text: str = "", status: str = "ok") -> None:
        """Append tokens from elsewhere (a tool result, an observation, template wrappers): context, not loss."""
        self._append(kind, ids, 0, None, text, status)

    def new_segment(self, prompt_ids: list[int], note: str) -> None:
        """Start a new segment at ``prompt_ids`` (the context no longer extends the recorded one), saying why."""
        self.trajectory.segments.append(self._segment(prompt_ids))
        self.trajectory.notes.append(note)

    def count(self, name: str, by: int = 1) -> None:
        """Add to one of the trajectory's counters."""
        self.trajectory.stats[name] = self.trajectory.stats.get(name, 0) + by

    def finish(self, reason: FinishReason, response: str = "", error: str | None = None) -> Trajectory:
        """The trajectory, finished for ``reason`` with the final answer ``response``."""
        trajectory = self.trajectory
        trajectory.finish_reason, trajectory.response, trajectory.error = reason, response, error
        return trajectory

    def _segment(self, prompt_ids: list[int]) -> Segment:
        return Segment(list(prompt_ids), logprobs=[] if self.with_logprobs else None)

    def _append(
        self, kind: TurnKind, ids: list[int], mask: int, logprobs: list[float] | None, text: str, status: str
    ) -> None:
        segment = self.segment
        start = len(segment.response_ids)
        segment.response_ids += list(ids)
        segment.loss_mask += [mask] * len(ids)
        if segment.logprobs is not None:
            segment.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        index = len(self.trajectory.segments) - 1
        self.trajectory.turns.append(Turn(kind, index, start, start + len(ids), text, status))
