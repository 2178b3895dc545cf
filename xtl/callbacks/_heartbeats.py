"""What the rank watchdog decides from heartbeats: which rank is dead, failed or stalled, and the line naming it.

Pure logic, without a store or a thread (:mod:`xtl.callbacks._watchdog_thread` feeds it), so the decision is
tested without processes. Times are the observer's own ``time.monotonic()``: a heartbeat counts as new when its
counter changed since the observer last read it, so clocks of other hosts never enter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

RUNNING, FINISHED, FAILED, EXITED = "running", "finished", "failed", "exited"


@dataclass(frozen=True)
class Progress:
    """Where a rank's main thread is: ``phase`` (``forward/backward step 12``) and its place in the sequence of
    hooks every rank runs in the same order.

    Attributes:
        step: ``trainer.global_step`` when the phase began (optimizer steps completed before it).
        event: Phases entered since ``step`` began, so that comparing ``(step, event, sub)`` across ranks tells which
            rank is behind.
        sub: Micro-batches (backward calls) or validation batches done within the phase.
        phase: What the rank does: ``setup``, ``data loading step N``, ``forward/backward step N``, ``optimizer step
            N``, ``checkpoint save step N``, ``validation after step N``, ``training end``.
    """

    step: int = 0
    event: int = 0
    sub: int = 0
    phase: str = "setup"

    def enter(self, phase: str, step: int) -> Progress:
        """The next phase, ``phase`` at ``step`` (the event count restarts with each step)."""
        return Progress(step, self.event + 1 if step == self.step else 0, 0, phase)

    def advance(self) -> Progress:
        """One more micro-batch or validation batch in the same phase."""
        return replace(self, sub=self.sub + 1)

    @property
    def order(self) -> tuple[int, int, int]:
        """The comparable position: a rank with a smaller one is behind."""
        return (self.step, self.event, self.sub)


@dataclass(frozen=True)
class Beat:
    """One heartbeat, as a rank publishes it in the store.

    Attributes:
        rank: Global rank.
        host: Host name.
        pid: Process id.
        count: Heartbeats sent so far (an observer sees a new beat when it changed).
        progress: The rank's progress when it sent the beat.
        state: ``running``; ``finished`` (the fit ended), ``failed`` (an error of its own, ``error``) or ``exited``
            (it reported a verdict and is leaving): heartbeats stop and are not missed.
        error: ``Type: message`` of the error a ``failed`` rank ended with.
    """

    rank: int
    host: str
    pid: int
    count: int
    progress: Progress = field(default_factory=Progress)
    state: str = RUNNING
    error: str = ""

    def encode(self) -> bytes:
        """The store value."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, value: bytes) -> Beat:
        """A beat read back from the store."""
        data = json.loads(value)
        return cls(**{**data, "progress": Progress(**data["progress"])})

    def who(self) -> str:
        """``rank 1 (host nodeA, pid 1234)``."""
        return f"rank {self.rank} (host {self.host}, pid {self.pid})"


@dataclass
class RankView:
    """What one observer knows of one rank.

    Attributes:
        rank: The rank observed.
        seen_at: When its heartbeat last changed (or the observer started watching, before its first beat).
        beat: Its last heartbeat (``None`` before the first).
        moved_at: When its progress last changed.
        failed_at: When the observer first read its ``failed`` state, or saw its process exit with an error code.
        exit_status: ``killed by SIGKILL`` / ``exited with code 1`` when the observer launched the rank's process
            (Lightning's launcher) and saw it end.
    """

    rank: int
    seen_at: float
    beat: Beat | None = None
    moved_at: float | None = None  # None: seen_at
    failed_at: float | None = None
    exit_status: str | None = None

    def __post_init__(self) -> None:
        if self.moved_at is None:
            self.moved_at = self.seen_at

    def observe(self, beat: Beat, now: float) -> None:
        """Record ``beat`` read at ``now``."""
        old = self.beat
        if old is None or beat.count != old.count:
            self.seen_at = now
        if old is None or beat.progress.order != old.progress.order:
            self.moved_at = now
        if beat.state == FAILED and self.failed_at is None:
            self.failed_at = now
        self.beat = beat

    @property
    def settled(self) -> bool:
        """It stopped heartbeating on purpose, or its process ended: no beat is missed."""
        return self.exit_status is not None or (self.beat is not None and self.beat.state != RUNNING)

    def who(self) -> str:
        """``rank 1 (host nodeA, pid 1234)``, or ``rank 1`` before its first beat."""
        return self.beat.who() if self.beat else f"rank {self.rank}"

    def last_step(self) -> str:
        """Its phase at its last beat (``no heartbeat yet`` before the first)."""
        return self.beat.progress.phase if self.beat else "no heartbeat yet"


def diagnose(
    views: Mapping[int, RankView], now: float, dead_after: float, stall_after: float | None, failed_grace: float
) -> str | None:
    """The verdict on the observed ranks, or ``None`` while all is well.

    In this order: a rank whose process ended (seen by its launcher), a rank that failed with an error of its own,
    ranks whose heartbeat is older than ``dead_after``, then a stall: when the ranks that are behind all others (the
    least ``Progress.order``) made no progress for ``stall_after`` seconds, they are named with their phase (the
    ranks ahead of them wait in a collective for them). A failed rank, and a process that exited with an error code
    (not one killed by a signal), are named ``failed_grace`` seconds after the observer learnt of them, so that a
    rank that meets the same error reports its own instead.

    Args:
        views: This observer's view of each rank it watches (not itself).
        now: The observer's ``time.monotonic()``.
        dead_after: Seconds without a new heartbeat after which a rank is dead.
        stall_after: Seconds without progress after which the ranks behind are stalled (``None``: not checked).
        failed_grace: Seconds a ``failed`` rank is known before it is named.
    """
    known = [v for v in views.values() if v.failed_at is None or now - v.failed_at >= failed_grace]
    ended = [v for v in known if v.exit_status is not None and not _done(v)]
    if ended:
        return _join(f"{v.who()} {v.exit_status}; its last step: {v.last_step()}" for v in ended)
    failed = [v for v in known if v.failed_at is not None and v.beat is not None and v.beat.state == FAILED]
    if failed:
        return _join(f"{v.who()} failed with {v.beat.error}; its last step: {v.last_step()}" for v in failed)
    stale = [v for v in views.values() if not v.settled and now - v.seen_at > dead_after]
    if stale:
        return _join(_stale(v, now) for v in stale)
    return None if stall_after is None else stalled(views, now, stall_after)


def stalled(views: Mapping[int, RankView], now: float, stall_after: float) -> str | None:
    """The ranks everyone waits for, when they made no progress for ``stall_after`` seconds (else ``None``).

    ``views`` must hold every rank (the observer's own too) for the comparison to mean anything.
    """
    running = [v for v in views.values() if v.beat is not None and not v.settled]
    if len(running) < 2:
        return None
    least = min(v.beat.progress.order for v in running)
    behind = [v for v in running if v.beat.progress.order == least]
    still = min(now - v.moved_at for v in behind)
    if still <= stall_after:
        return None
    phase = behind[0].beat.progress.phase
    if len(behind) == len(running):
        ranks = ", ".join(str(v.rank) for v in behind)
        return (
            f"ranks {ranks} made no progress for {still:.0f} s, all at {phase} (a collective that no rank completes, "
            "or the same hang on every rank)"
        )
    ahead = sorted({v.beat.progress.phase for v in running if v.beat.progress.order != least})
    others = ", ".join(ahead[:3]) + (", ..." if len(ahead) > 3 else "")
    names = _join(v.beat.who() for v in behind)
    return f"{names} made no progress for {still:.0f} s at {phase} (the other ranks wait further on, at {others})"


def store_gone(host_rank: RankView | None, address: str) -> str:
    """The verdict when the store stopped answering: rank 0 hosts it under Lightning's and SLURM's launch
    (``host_rank``), torchrun's agent otherwise (``None``)."""
    if host_rank is None:
        return f"the rendezvous store at {address} (torchrun's agent) stopped answering"
    return f"{host_rank.who()} is gone: the store it hosts at {address} closed; its last step: {host_rank.last_step()}"


def _stale(view: RankView, now: float) -> str:
    if view.beat is None:
        return f"rank {view.rank} sent no heartbeat in {now - view.seen_at:.0f} s"
    return f"{view.who()} stopped heartbeating {now - view.seen_at:.0f} s ago; its last step: {view.last_step()}"


def _done(view: RankView) -> bool:
    return view.beat is not None and view.beat.state in (FINISHED, EXITED)


def _join(parts: object) -> str:
    parts = list(parts)
    shown = "; ".join(parts[:4])
    return shown + (f"; and {len(parts) - 4} more ranks" if len(parts) > 4 else "")
