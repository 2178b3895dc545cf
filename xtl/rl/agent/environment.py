"""The environment loop: the model acts in text environments with gymnasium's ``reset``/``step`` contract.

An environment is any object with

- ``reset(seed=None, options=None) -> (observation, info)``: ``options`` is ``{"row": <the prompt row>}``; a
  non-empty observation is appended to the prompt as a user turn;
- ``step(action) -> (observation, reward, terminated, truncated, info)``: ``action`` is the answer text of the
  model's turn (reasoning removed); the observation comes back as the next user turn (loss mask 0).

so a ``gymnasium.Env`` with text spaces works as it is. Each trajectory gets its own environment, made by calling
``environment`` (a class or factory, or its import path) with ``environment_args``. A trajectory ends when its
environment terminates (``stop``) or truncates, or at ``max_turns`` / ``max_tokens`` (``length``). Its reward is the
sum of the step rewards: the judger is not asked. An environment that raises aborts its own trajectory (the sample
does not train), never the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xtl.errors import ConfigError
from xtl.rl.agent.loop import AgentContext, AgentLoop, lockstep_generate
from xtl.rl.agent.tools import import_callable
from xtl.rl.agent.trajectory import Trajectory, TrajectoryBuilder
from xtl.rl.rollout import RolloutEngine, SamplingSettings

KEY = "model.init_args.agent.init_args"


class EnvironmentLoop(AgentLoop):
    """Multi-turn rollouts in ``reset``/``step`` environments (module docstring).

    Args:
        environment: A class or factory of environments, or its import path.
        environment_args: Keyword arguments of each ``environment(...)`` call.
        max_turns: Model turns per trajectory at most.
        max_tokens: Response tokens per trajectory (sampled and appended) after which it stops.
        seed: Base seed of the environments' ``reset`` (the row's index and group member are added).

    Raises:
        ConfigError: The environment cannot be imported, a budget below 1.
    """

    def __init__(
        self,
        environment: Callable[..., Any] | str,
        environment_args: dict[str, Any] | None = None,
        max_turns: int = 8,
        max_tokens: int = 1024,
        seed: int = 0,
    ) -> None:
        self.name = environment if isinstance(environment, str) else repr(environment)
        if isinstance(environment, str):
            environment = import_callable(environment, f"{KEY}.environment")
        self.factory = environment
        self.environment_args = dict(environment_args or {})
        for name, value in (("max_turns", max_turns), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or value < 1:
                raise ConfigError(f"{KEY}.{name} must be >= 1, got {value!r}")
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.seed = seed
        self._episodes = 0

    def describe(self) -> str:
        """The environment and budgets."""
        return f"environment loop ({self.name}; at most {self.max_turns} turns, {self.max_tokens} tokens)"

    def rollout(
        self, rows: list[dict[str, Any]], engine: RolloutEngine, sampling: SamplingSettings, context: AgentContext
    ) -> list[Trajectory]:
        """Run every row's episode to its end, one engine call per turn."""
        episodes = [self._start(row, context) for row in rows]
        while True:
            indices = [i for i, e in enumerate(episodes) if e.result is None]
            active = [episodes[i] for i in indices]
            rollouts = lockstep_generate(engine, [e.builder.context_ids for e in active], sampling, context, indices)
            if rollouts is None:
                break
            for episode, rollout in zip(active, rollouts, strict=True):
                episode.act(rollout, self.max_turns, self.max_tokens)
        return [e.result if e.result is not None else e.builder.finish("abort", error="never ran") for e in episodes]

    def state_dict(self) -> dict[str, Any]:
        """The episodes started (the next reset's seed derives from it)."""
        return {"episodes": self._episodes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._episodes = int(state.get("episodes", 0))

    def _start(self, row: dict[str, Any], context: AgentContext) -> _Episode:
        seed = self.seed + self._episodes
        self._episodes += 1
        return _Episode(row, context, lambda: self.factory(**self.environment_args), seed)


# ---- private ---------------------------------------------------------------------------------------------------


class _Episode:
    """One trajectory of the loop: its environment, messages, builder and return."""

    def __init__(self, row: dict[str, Any], context: AgentContext, make: Callable[[], Any], seed: int) -> None:
        self.chat = context.chat
        self.messages: list[dict[str, Any]] = [dict(m) for m in row["prompt"]]
        self.result: Trajectory | None = None
        self.turns = 0
        self.total = 0.0
        self.seconds = 0.0
        self.answer = ""
        try:
            self.env = make()
            observation, _ = self.env.reset(seed=seed, options={"row": row})
        except Exception as err:  # the environment's failure costs this trajectory
            self.builder = TrajectoryBuilder(self.chat.prompt_ids(self.messages))
            self._end("abort", f"reset raised {type(err).__name__}: {err}")
            return
        if observation:
            self.messages.append({"role": "user", "content": str(observation)})
        self.builder = TrajectoryBuilder(self.chat.prompt_ids(self.messages))

    def act(self, rollout: Any, max_turns: int, max_tokens: int) -> None:
        """Take the sampled turn as the action, step the environment and append its observation."""
        self.seconds += rollout.seconds
        self.builder.sampled(rollout.response_ids, rollout.logprobs)
        self.turns += 1
        self.answer = self.chat.answer(rollout.response_ids)
        self.messages.append({"role": "assistant", "content": self.answer})
        if rollout.finish_reason != "stop":
            self._end("length" if rollout.finish_reason == "length" else "abort")
            return
        try:
            observation, reward, terminated, truncated, _ = self.env.step(self.answer)
        except Exception as err:
            self._end("abort", f"step raised {type(err).__name__}: {err}")
            return
        self.total += float(reward)
        if terminated:
            self._end("stop")
        elif truncated or self.turns >= max_turns or self.builder.response_tokens >= max_tokens:
            self._end("length")
        else:
            self.messages.append({"role": "user", "content": str(observation)})
            ids = self.chat.continuation_ids(self.messages)
            if ids is None:
                self._end("abort", "the template cannot continue this conversation")
                return
            self.builder.appended(ids, "environment", str(observation)[:80])
            if self.builder.response_tokens >= max_tokens:
                self._end("length")

    def _end(self, reason: str, error: str | None = None) -> None:
        trajectory = self.builder.finish(reason, self.answer, error)  # type: ignore[arg-type]
        trajectory.messages = self.messages
        trajectory.reward = None if reason == "abort" else self.total
        trajectory.seconds = self.seconds
        trajectory.stats["turns"] = self.turns
        self.result = trajectory
