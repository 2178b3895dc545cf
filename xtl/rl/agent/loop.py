"""The agent-loop seam: how one prompt becomes one :class:`~xtl.rl.agent.trajectory.Trajectory`.

An :class:`AgentLoop` takes a batch of prompt rows (a prompt repeated ``group_size`` times for its group) and returns
one trajectory per row, using the rollout engine for every sampled turn. Loops run their trajectories' turns
together: each turn is one engine call over every trajectory still going, so the local engine decodes them as one
batch. Built-ins:

- :class:`SingleTurnLoop`: one completion per prompt (the default; what GRPO sampled before loops existed);
- :class:`~xtl.rl.agent.tool_loop.ToolLoop`: the model calls tools and reads their results, turn after turn;
- :class:`~xtl.rl.agent.environment.EnvironmentLoop`: the model acts in ``reset``/``step`` environments;
- :class:`~xtl.rl.agent.server.BlackBoxAgentLoop`: an external agent program runs its own loop against an
  OpenAI-compatible endpoint served from the engine.

A row with images (a vision-language policy) keeps them for its whole trajectory: the context's ``images`` (one entry
per row) go with every engine call of the row's turns.

Under sharded parameters every rank must run the same engine calls: :func:`lockstep_generate` makes a rank whose
trajectories have all finished still join a turn that another rank needs (:meth:`RolloutEngine.idle_step`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xtl.rl import trace
from xtl.rl.agent.chat import ChatFormat
from xtl.rl.agent.trajectory import Trajectory, TrajectoryBuilder
from xtl.rl.rollout import Rollout, RolloutEngine, SamplingSettings
from xtl.rl.vision import PromptImages


@dataclass
class AgentContext:
    """What a loop needs besides the engine.

    Attributes:
        chat: The run's chat format (render, parse, continue).
        agree: The most of a count over the data-parallel ranks (``None``: one rank); loops call it once per turn
            with their number of unfinished trajectories, through :func:`lockstep_generate`.
        sample_ids: The rows' sample ids (aligned with the rows of :meth:`AgentLoop.rollout`), for the rollout
            trace (:mod:`xtl.rl.trace`); ``None``: not traced per sample.
        images: The rows' images (aligned with the rows; ``None`` for a row without), which every engine call of a
            row's turns passes with its context; ``None``: no row has images.
    """

    chat: ChatFormat
    agree: Callable[[int], int] | None = None
    sample_ids: list[str] | None = None
    images: list[PromptImages | None] | None = None

    def ids(self, indices: list[int] | None = None) -> list[str]:
        """The sample ids of the rows at ``indices`` (every row's by default; ``[]`` when untraced)."""
        if self.sample_ids is None:
            return []
        return list(self.sample_ids) if indices is None else [self.sample_ids[i] for i in indices]

    def images_at(self, indices: list[int] | None = None) -> list[PromptImages | None] | None:
        """The images of the rows at ``indices`` (every row's by default; ``None`` when no row has images)."""
        if self.images is None:
            return None
        return list(self.images) if indices is None else [self.images[i] for i in indices]


class AgentLoop(ABC):
    """Turns prompt rows into trajectories (module docstring).

    Attributes:
        image_refusal: Why the loop cannot run prompts with images (``None``: it can; the built-in loops pass each
            row's images with every engine call of its turns).
    """

    image_refusal: str | None = None

    @abstractmethod
    def rollout(
        self, rows: list[dict[str, Any]], engine: RolloutEngine, sampling: SamplingSettings, context: AgentContext
    ) -> list[Trajectory]:
        """One trajectory per row, in order.

        Args:
            rows: Prompt rows (``prompt`` messages, ``answer``, ``data_source``, ...), a row repeated for each member
                of its group.
            engine: Samples each turn.
            sampling: How turns are sampled (``max_new_tokens`` is per turn).
            context: The chat format and the ranks' agreement.
        """

    def describe(self) -> str:
        """One line for the start-of-run summary."""
        return type(self).__name__

    def state_dict(self) -> dict[str, Any]:
        """What resumes the loop exactly (e.g. the environments' seeds)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional hook: nothing to restore)
        """Restore :meth:`state_dict`."""

    def close(self) -> None:  # noqa: B027 (optional hook: nothing to release by default)
        """Release what the loop holds (servers, processes) at the end of the run."""


class SingleTurnLoop(AgentLoop):
    """One sampled completion per prompt: the prompt rendered with the template, one engine call for the batch."""

    def rollout(
        self, rows: list[dict[str, Any]], engine: RolloutEngine, sampling: SamplingSettings, context: AgentContext
    ) -> list[Trajectory]:
        """Sample every row's completion in one engine call."""
        chat = context.chat
        prompts = [chat.prompt_ids(row["prompt"]) for row in rows]
        with trace.current().span("engine.generate", "generate", context.ids(), requests=len(prompts)):
            rollouts = engine_generate(engine, prompts, sampling, chat.stop_token_ids, context.images_at())
        out = []
        for row, rollout in zip(rows, rollouts, strict=True):
            builder = TrajectoryBuilder(rollout.prompt_ids)
            builder.sampled(rollout.response_ids, rollout.logprobs)
            trajectory = builder.finish(rollout.finish_reason, chat.answer(rollout.response_ids))
            trajectory.messages = [*row["prompt"], {"role": "assistant", "content": trajectory.response}]
            trajectory.seconds = rollout.seconds
            out.append(trajectory)
        return out


def lockstep_generate(
    engine: RolloutEngine,
    prompts: list[list[int]],
    sampling: SamplingSettings,
    context: AgentContext,
    indices: list[int] | None = None,
) -> list[Rollout] | None:
    """One engine call over ``prompts``, joined by every rank that still has turns to sample (``indices``: the rows
    the prompts belong to, for the trace).

    Returns:
        The rollouts (one per prompt), or ``None`` when no rank has a prompt left (the loop is over). A rank with no
        prompt of its own but others still going decodes a one-token filler and gets ``[]``.
    """
    wanted = context.agree(len(prompts)) if context.agree is not None else len(prompts)
    if wanted == 0:
        return None
    if prompts:
        with trace.current().span("engine.generate", "generate", context.ids(indices), requests=len(prompts)):
            stop = context.chat.stop_token_ids
            return engine_generate(engine, prompts, sampling, stop, context.images_at(indices))
    engine.idle_step(sampling, context.chat.stop_token_ids)
    return []


def engine_generate(
    engine: RolloutEngine,
    prompts: list[list[int]],
    sampling: SamplingSettings,
    stop_token_ids: tuple[int, ...],
    images: list[PromptImages | None] | None = None,
) -> list[Rollout]:
    """``engine.generate`` with the prompts' images when some prompt has images (an engine for text prompts only
    is called as before)."""
    if images is None or all(entry is None for entry in images):
        return engine.generate(prompts, sampling, stop_token_ids)
    return engine.generate(prompts, sampling, stop_token_ids, images=images)
