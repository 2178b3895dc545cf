"""Several tasks in one RL run: each rollout batch draws its prompts from each task (a ``data_source`` of the prompt
rows) by a share of its own, and the batch's results are logged per task. Each task's judger is a branch of a
:class:`~xtl.rl.ComposedJudger` (it routes on ``data_source``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from xtl.rl.buffer import Group, SampleState


class TaskMix:
    """Prompt draws split over tasks by share, and per-task metrics.

    Args:
        shares: ``task (data_source) -> share`` of each draw (normalized; each > 0).
    """

    def __init__(self, shares: dict[str, float]) -> None:
        total = sum(shares.values())
        self.shares = {task: share / total for task, share in shares.items()}

    def counts(self, count: int) -> dict[str, int]:
        """``count`` prompts split by share: floors, then the largest remainders (ties: the order of the tasks)."""
        exact = {task: count * share for task, share in self.shares.items()}
        out = {task: math.floor(value) for task, value in exact.items()}
        rest = sorted(exact, key=lambda task: out[task] - exact[task])[: count - sum(out.values())]
        for task in rest:
            out[task] += 1
        return out

    def take(self, take_task: Callable[[str, int], list[dict[str, Any]]], count: int) -> list[dict[str, Any]]:
        """The next ``count`` prompt rows, each task's share drawn from it (``take_task(task, n)``), task by task."""
        return [row for task, n in self.counts(count).items() if n for row in take_task(task, n)]

    def metrics(self, groups: list[Group]) -> dict[str, float]:
        """Per task: the batch's groups (``rollout/task/<task>/groups``), its judged rewards' mean and the samples
        that train (``completed``)."""
        out: dict[str, float] = {}
        for task in self.shares:
            mine = [g for g in groups if g.row.get("data_source") == task]
            rewards = [r for g in mine for r in g.rewards]
            out[f"rollout/task/{task}/groups"] = float(len(mine))
            out[f"rollout/task/{task}/reward_mean"] = sum(rewards) / len(rewards) if rewards else 0.0
            out[f"rollout/task/{task}/samples"] = float(
                sum(s.state == SampleState.COMPLETED for g in mine for s in g.samples)
            )
        return out
