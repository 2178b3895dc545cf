"""Asynchronous rollout production: a thread that produces rollout batches while the trainer updates.

The thread drives an engine that samples in other processes (Ray actors: :meth:`RolloutEngine.samples_elsewhere`),
so generation overlaps the trainer's forwards and backwards; judging and the agent loop's bookkeeping run on the
thread. What each batch samples with is fixed ahead, so a run does not depend on timing:

- a policy *version* is the weights after a number of rollout batches' updates: batch ``n`` trains version ``n``;
- batch ``n`` is sampled with version ``max(0, n - max_staleness)``: at most ``max_staleness`` versions older than
  the policy it trains (``0``: its own, which is the synchronous run);
- the trainer publishes version ``v`` (:meth:`AsyncProducer.publish`) when it starts training batch ``v``, if some
  batch is sampled with it; the thread waits for it (the wait is the batch's ``pause_seconds``).

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
        version: The policy version that sampled it.
        groups: Its groups.
        stats: Its accounting.
    """

    index: int
    version: int
    groups: list[Group]
    stats: ProduceStats


def sampling_version(index: int, max_staleness: int) -> int:
    """The policy version that samples rollout batch ``index`` (module docstring)."""
    return max(0, index - max_staleness)


class AsyncProducer:
    """Produces rollout batches on a thread, each with the weights the schedule assigns it (module docstring).

    Args:
        produce: Produces batch ``index`` once the engine samples with policy version ``version``:
            ``produce(index, version) -> (groups, stats)``.
        adopt: Makes the engine sample with published weights (called on the thread, before ``produce``).
        max_staleness: How many versions the sampling weights may lag the policy.
        start: The first batch to produce (a resumed run's next one).
    """

    def __init__(
        self,
        produce: Callable[[int, int], tuple[list[Group], ProduceStats]],
        adopt: Callable[[Any], None],
        max_staleness: int,
        start: int = 0,
    ) -> None:
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

    def needs(self, version: int) -> bool:
        """Whether a batch not produced yet is sampled with policy version ``version`` (not published yet)."""
        with self._cond:
            first = self._next + (1 if self._busy else 0)
            wanted = {self.version(i) for i in range(first, first + self.max_staleness + 2)}
            return version in wanted and version not in self._weights

    def version(self, index: int) -> int:
        """The policy version that samples batch ``index``."""
        return sampling_version(index, self.max_staleness)

    def publish(self, version: int, weights: Any) -> None:
        """Hand the thread policy version ``version`` (a snapshot of its weights the engine adopts)."""
        with self._cond:
            self._weights[version] = weights
            self._cond.notify_all()

    def take(self, index: int) -> Produced:
        """Batch ``index``, waiting for it.

        Raises:
            RuntimeError: The thread failed (its error is the cause), was stopped, or waits for weights that were
                not published (the two would wait for each other).
        """
        with self._cond:
            while index not in self._done:
                self._raise_if_failed()
                if self._stop:
                    raise RuntimeError("the rollout producer was stopped")
                if self._next > index:
                    raise RuntimeError(f"rollout batch {index} was taken already")
                if not self._busy and self.version(self._next) not in self._weights:  # both would wait forever
                    raise RuntimeError(
                        f"rollout batch {index} waits for batch {self._next}, whose policy version "
                        f"{self.version(self._next)} was not published"
                    )
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
                trace.current().event("producer.pause", "pause", step=index, seconds=waited, version=version)
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
