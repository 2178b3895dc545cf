"""Asynchronous rollout production: a thread that produces rollout batches while the trainer updates.

The thread drives an engine that samples in other processes (Ray actors: :meth:`RolloutEngine.samples_elsewhere`),
so generation overlaps the trainer's forwards and backwards; judging and the agent loop's bookkeeping run on the
thread. What each batch samples with is fixed ahead, so a run does not depend on timing:

- rollout batch ``n`` trains from optimizer step ``n * k`` (``k`` optimizer steps per batch);
- it is sampled with the policy's weights after step ``version(n) = max(0, n * k - max_staleness)``: at most
  ``max_staleness`` steps older than the policy it trains (``0``: the weights of its own first step, which is the
  synchronous run);
- the trainer publishes the weights of step ``s`` (:meth:`AsyncProducer.publish`) at the start of step ``s`` when
  some batch is sampled with them; the thread waits for them (the wait is the batch's ``pause_seconds``).

A checkpoint drains the thread first (:meth:`AsyncProducer.drain`: every batch whose weights are published is
finished) and keeps the finished batches that have not trained yet, so a resumed run trains exactly what the
uninterrupted one does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xtl.rl import trace
from xtl.rl.buffer import Group, ProduceStats


@dataclass
class Produced:
    """One rollout batch from the producer.

    Attributes:
        index: The batch's number (0, 1, ...).
        version: The optimizer step whose weights sampled it.
        groups: Its groups.
        stats: Its accounting.
    """

    index: int
    version: int
    groups: list[Group]
    stats: ProduceStats


def sampling_version(index: int, steps_per_batch: int, max_staleness: int) -> int:
    """The optimizer step whose weights sample rollout batch ``index`` (module docstring)."""
    return max(0, index * steps_per_batch - max_staleness)


class AsyncProducer:
    """Produces rollout batches on a thread, each with the weights the schedule assigns it (module docstring).

    Args:
        produce: Produces batch ``index`` once the engine samples with the weights of step ``version``:
            ``produce(index, version) -> (groups, stats)``.
        adopt: Makes the engine sample with published weights (called on the thread, before ``produce``).
        steps_per_batch: Optimizer steps each batch trains (``k``).
        max_staleness: How many steps the sampling weights may lag the policy.
        start: The first batch to produce (a resumed run's next one).
    """

    def __init__(
        self,
        produce: Callable[[int, int], tuple[list[Group], ProduceStats]],
        adopt: Callable[[Any], None],
        steps_per_batch: int,
        max_staleness: int,
        start: int = 0,
    ) -> None:
        self.steps_per_batch = steps_per_batch
        self.max_staleness = max_staleness
        self._produce = produce
        self._adopt = adopt
        self._next = start  # the next batch the thread produces
        self._adopted: int | None = None
        self._weights: dict[int, Any] = {}
        self._done: dict[int, Produced] = {}
        self._busy = False
        self._error: BaseException | None = None
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="xtl-rollout-producer", daemon=True)
        self._thread.start()

    def needs(self, step: int, consumed: int) -> bool:
        """Whether some batch not produced yet (from ``consumed`` on) is sampled with the weights of ``step``."""
        first = max(consumed, self._next)
        last = first + self.max_staleness // max(self.steps_per_batch, 1) + 2
        versions = {self.version(i) for i in range(first, last)}
        return step in versions and step not in self._weights

    def version(self, index: int) -> int:
        """The step whose weights sample batch ``index``."""
        return sampling_version(index, self.steps_per_batch, self.max_staleness)

    def publish(self, step: int, weights: Any) -> None:
        """Hand the thread the weights after optimizer step ``step`` (a snapshot the engine adopts)."""
        with self._cond:
            self._weights[step] = weights
            self._cond.notify_all()

    def take(self, index: int) -> Produced:
        """Batch ``index``, waiting for it.

        Raises:
            RuntimeError: The thread failed (its error is the cause) or was stopped.
        """
        with self._cond:
            while index not in self._done:
                self._raise_if_failed()
                if self._stop:
                    raise RuntimeError("the rollout producer was stopped")
                if self._next > index:
                    raise RuntimeError(f"rollout batch {index} was taken already")
                self._cond.wait(timeout=1.0)
            return self._done.pop(index)

    def drain(self) -> list[Produced]:
        """Wait until every batch whose weights are published is produced; the produced batches not taken yet.

        Raises:
            RuntimeError: The thread failed.
        """
        with self._cond:
            while self._busy or self.version(self._next) in self._weights:
                self._raise_if_failed()
                self._cond.wait(timeout=1.0)
            self._raise_if_failed()
            return [self._done[i] for i in sorted(self._done)]

    @property
    def next_index(self) -> int:
        """The next batch the thread produces."""
        return self._next

    def restore(self, done: list[Produced]) -> None:
        """Put back batches produced before a checkpoint (they are taken as if produced now)."""
        with self._cond:
            for item in done:
                self._done[item.index] = item
            self._cond.notify_all()

    def stop(self) -> None:
        """End the thread (it finishes the batch it is producing)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=600)

    # ---- private ---------------------------------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout producer failed: {self._error}") from self._error

    def _run(self) -> None:
        try:
            while True:
                began = time.perf_counter()
                with self._cond:
                    index = self._next
                    version = self.version(index)
                    while version not in self._weights and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    weights = self._weights[version]
                    self._busy = True
                waited = time.perf_counter() - began
                trace.current().event("producer.pause", "pause", step=index * self.steps_per_batch, seconds=waited,
                                      version=version)  # fmt: skip
                if self._adopted != version:
                    self._adopt(weights)
                    self._adopted = version
                groups, stats = self._produce(index, version)
                stats.pause_seconds += waited
                with self._cond:
                    self._done[index] = Produced(index, version, groups, stats)
                    self._next = index + 1
                    self._busy = False
                    for old in [v for v in self._weights if v < self.version(self._next)]:
                        del self._weights[old]  # no later batch samples with them
                    self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the trainer thread, which raises it
            with self._cond:
                self._error = err
                self._busy = False
                self._cond.notify_all()
