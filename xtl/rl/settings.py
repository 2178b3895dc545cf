"""The grouped settings of :class:`~xtl.rl.GRPOModule`: how a rollout batch is produced (:class:`RolloutSettings`)
and how it is cut into optimizer steps (:class:`UpdateSettings`); the engine's are
:class:`~xtl.rl.engines.EngineSettings`. Each checks its own ranges and names the YAML key it refuses.

:data:`MOVED_KEYS` maps the flat keys of earlier releases to their place in the groups: :func:`moved_key` says
where one went (the ``xtl`` command checks configs with it before parsing, :class:`~xtl.rl.GRPOModule` checks its
keyword arguments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from xtl.errors import ConfigError

KEY = "model.init_args"
# a flat model.init_args key of earlier releases -> where it went (under model.init_args)
MOVED_KEYS = {
    "prompts_per_step": "rollout.prompts_per_step",
    "dynamic_sampling": "rollout.dynamic_sampling",
    "max_rounds": "rollout.max_rounds",
    "oversample": "rollout.oversample",
    "max_staleness": "rollout.max_staleness",
    "overlong_buffer": "rollout.overlong_buffer",
    "overlong_penalty": "rollout.overlong_penalty",
    "mini_batches": "updates.mini_batches",
    "epochs": "updates.epochs",
    "micro_batches": "updates.micro_batches",
    "vllm": "engine.vllm",
    "ray": "engine.ray",
    "importance_sampling_cap": "engine.importance_sampling_cap",
}
ENGINE_KEY = "engine"  # once a name (engine: vllm), now a group (engine: {name: vllm})


@dataclass
class RolloutSettings:
    """How each rollout batch is produced (``model.init_args.rollout``).

    Args:
        prompts_per_step: Prompts (groups) per rank in each rollout batch.
        dynamic_sampling: DAPO: drop groups whose rewards are all equal and draw more prompts (``max_rounds``).
        max_rounds: Generation rounds per rollout batch at most.
        oversample: Each round draws this many times the missing prompts (above 1 with dynamic sampling, so one round
            usually brings enough groups; the surplus waits in the replay buffer for the next batch).
        max_staleness: A group trains while at most this many policy versions older than the policy it trains (a
            version: the weights after a rollout batch's updates; leftover groups older than that expire). With
            ``asynchronous``, also how far ahead rollouts are produced: rollout batch ``n`` is sampled with version
            ``n - max_staleness`` (``0``: its own, the synchronous run).
        asynchronous: Produce rollout batches on a separate worker while the trainer updates (an engine that samples
            in other processes: ``engine.name: ray``); see :mod:`xtl.rl.producer`.
        partial_tokens: Partial rollouts (single-turn): an engine call samples at most this many tokens of a
            completion; unfinished groups wait and are continued by the next rollout batch, with its weights
            (``None``: completions are sampled whole).
        max_resumes: With ``partial_tokens``, a completion still unfinished after this many continuations expires.
        tasks: Several tasks in one run: ``data_source -> share`` of each rollout batch's prompts (each task's rows
            drawn in an order of their own; results logged per task as ``rollout/task/<data_source>/...``; score each
            task with its own judger through a ``ComposedJudger``). ``None``: one stream of every row.
        overlong_buffer: DAPO's soft overlong punishment: the last ``overlong_buffer`` tokens before
            ``sampling.max_new_tokens`` lower the reward linearly to ``-overlong_penalty`` (``None``: off).
        overlong_penalty: See ``overlong_buffer``.

    Raises:
        ConfigError: Naming the first setting out of range.
    """

    prompts_per_step: int = 16
    dynamic_sampling: bool = False
    max_rounds: int = 1
    oversample: float = 1.0
    max_staleness: int = 1
    overlong_buffer: int | None = None
    overlong_penalty: float = 1.0
    asynchronous: bool = False
    partial_tokens: int | None = None
    max_resumes: int = 2
    tasks: dict[str, float] | None = None

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "max_rounds"):
            _at_least(f"rollout.{name}", getattr(self, name), 1)
        _at_least("rollout.max_resumes", self.max_resumes, 0)
        if self.partial_tokens is not None:
            _at_least("rollout.partial_tokens", self.partial_tokens, 1)
        if self.tasks is not None:
            if not self.tasks:
                raise ConfigError(f"{KEY}.rollout.tasks is empty: name each data_source with its share, or remove it")
            for task, share in self.tasks.items():
                if isinstance(share, bool) or not share > 0:
                    raise ConfigError(f"{KEY}.rollout.tasks.{task} must be a share > 0, got {share!r}")
            self.tasks = {str(task): float(share) for task, share in self.tasks.items()}
        _at_least("rollout.max_staleness", self.max_staleness, 0)
        _at_least("rollout.oversample", self.oversample, 1)
        _at_least("rollout.overlong_penalty", self.overlong_penalty, 0)
        if self.overlong_buffer is not None:
            _at_least("rollout.overlong_buffer", self.overlong_buffer, 1)


@dataclass
class UpdateSettings:
    """How each rollout batch is cut into optimizer steps (``model.init_args.updates``).

    Args:
        mini_batches: Optimizer steps each rollout batch is cut into.
        epochs: Passes over each rollout batch (``epochs * mini_batches`` steps per batch).
        micro_batches: Packed micro-batches per rank in each optimizer step (the same on every rank).

    Raises:
        ConfigError: Naming the first setting out of range.
    """

    mini_batches: int = 1
    epochs: int = 1
    micro_batches: int = 1

    def __post_init__(self) -> None:
        for name in ("mini_batches", "epochs", "micro_batches"):
            _at_least(f"updates.{name}", getattr(self, name), 1)

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps per rollout batch."""
        return self.epochs * self.mini_batches


torch.serialization.add_safe_globals([RolloutSettings, UpdateSettings])  # hyperparameters in checkpoints


def moved_key(key: str, value: Any = None, prefix: str = f"{KEY}.") -> str | None:
    """Where the flat ``key`` of an earlier release went (``None`` when it did not move); ``value`` tells an
    ``engine`` given as a name (moved to ``engine.name``) from the group."""
    if key == ENGINE_KEY and isinstance(value, str) and not value.lstrip().startswith("{"):
        return f"{prefix}{key}: {value} has moved to {prefix}{key}.name ({_GROUPS})"
    if key not in MOVED_KEYS:
        return None
    return f"{prefix}{key} has moved to {prefix}{MOVED_KEYS[key]} ({_GROUPS})"


# ---- private ---------------------------------------------------------------------------------------------------

_GROUPS = "GRPOModule's settings are grouped under rollout:, updates: and engine:, see docs/configs.md"


def _at_least(name: str, value: float, low: float) -> None:
    if isinstance(value, bool) or value < low:
        raise ConfigError(f"{KEY}.{name} must be >= {low:g}, got {value!r}")
