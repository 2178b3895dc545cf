"""The rank watchdog's background thread: heartbeats through the process group's store, the verdict, the exit.

Every ``interval`` seconds each rank's thread writes its :class:`~xtl.callbacks._heartbeats.Beat` under
``xtl/watchdog/beat/<rank>`` of its own connection to the default process group's store (``Store.clone()``: torch's
way to use a store from another thread) and looks for a verdict under ``xtl/watchdog/verdict``. Rank 0 reads every
rank's beat and decides (:func:`~xtl.callbacks._heartbeats.diagnose`); the other ranks read rank 0's only (so the
store serves ``O(ranks)`` reads per interval, not ``O(ranks^2)``), and every rank once a collective of its own failed
(:meth:`Watch.suspect`). The first rank to decide publishes the verdict (``compare_set``: the first one wins), and
every rank that reads it prints the same line and exits.

Under Lightning's launcher (and SLURM's), rank 0's process hosts the store, so rank 0's death closes it: an idle
socket to the store's port (the sentinel) reads end-of-file at once, and the other ranks name rank 0 from its last
beat without touching the dead store (whose clients print C++ stack dumps when an operation fails). Rank 0 therefore
keeps its process, and so the store, alive after a verdict (or its own failure, or the end of the fit) until every
other rank has read what it needs (bounded).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from subprocess import Popen
from typing import Any

import torch.distributed as dist

from xtl.callbacks._heartbeats import EXITED, FINISHED, RUNNING, Beat, Progress, RankView, diagnose, store_gone
from xtl.errors import debug_enabled

EXIT_CODE = 75  # EX_TEMPFAIL: a peer failed; running the job again may succeed
PREFIX = "xtl/watchdog/"
VERDICT = "verdict"
_REPORTED = threading.Lock()  # one line per process, whichever thread gets there first


class StoreGone(Exception):
    """The store stopped answering for good."""


class Watch(threading.Thread):
    """The heartbeat thread of one rank.

    Args:
        store: This thread's own connection (a clone of the default group's store).
        address: ``host:port`` of the store's server, for the sentinel and the messages.
        rank: This rank.
        world_size: Ranks in the default group.
        progress: Returns the main thread's current :class:`Progress` (a plain attribute read: no lock).
        interval: Seconds between heartbeats.
        dead_after: Seconds without a heartbeat after which a rank is dead.
        stall_after: Seconds without progress after which the ranks behind are stalled (``None``: not checked).
        hosts_store: This process hosts the store (rank 0 under Lightning's or SLURM's launch).
        rank0_hosts_store: Rank 0 hosts the store (else torchrun's agent does).
        children: ``{global rank: process}`` of the ranks this process launched (Lightning's launcher).
        kill_children: Kills the launched ranks still running (before this process exits).
        flush: Flushes the trainer's loggers (called, bounded, before the exit).
        terminating: Whether the process got SIGTERM (torchrun's agent stops the other ranks when one dies: then
            the watch looks for the dead rank as after a failed collective, before the agent's SIGKILL 30 s later).
    """

    def __init__(
        self,
        store: dist.Store,
        address: tuple[str, int] | None,
        rank: int,
        world_size: int,
        progress: Callable[[], Progress],
        interval: float,
        dead_after: float,
        stall_after: float | None,
        hosts_store: bool,
        rank0_hosts_store: bool,
        children: dict[int, Popen] | None = None,
        kill_children: Callable[[], None] | None = None,
        flush: Callable[[], None] | None = None,
        terminating: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(name="xtl-rank-watchdog", daemon=True)
        self.store = store
        self.address = address
        self.rank = rank
        self.world_size = world_size
        self.progress = progress
        self.interval = interval
        self.dead_after = dead_after
        self.stall_after = stall_after
        self.suspect_after = 3 * interval  # once a collective failed: a rank this late is the one that died
        self.hosts_store = hosts_store
        self.rank0_hosts_store = rank0_hosts_store
        self.children = children or {}
        self.kill_children = kill_children
        self.flush = flush
        self.terminating = terminating
        self.host = socket.gethostname()
        self.count = 0
        self.exception: BaseException | None = None  # the main thread's error that made it suspect a peer
        self._ending: tuple[str, str] | None = None  # (state, error) the main thread asked to publish last
        self._wake = threading.Event()
        self._ended = threading.Event()
        self._fast = False
        self._noted = False
        self._sentinel: socket.socket | None = None
        self._last_ok = time.monotonic()
        start = time.monotonic()
        self.views = {r: RankView(r, start) for r in range(world_size)}

    # ---- the main thread's side ----------------------------------------------------------------------------------

    def suspect(self, exception: BaseException, timeout: float) -> None:
        """A collective of the main thread failed: watch every rank, with ``3 * interval`` as the dead time, for up
        to ``timeout`` seconds. Returns when no rank was found dead (the process exits from this thread when one
        is)."""
        self.exception = exception
        self._fast = True
        self._wake.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.is_alive():
            with contextlib.suppress(Exception):  # a signal handler's error (Lightning's SIGTERM broadcast)
                self._ended.wait(min(0.2, max(0.0, deadline - time.monotonic())))

    def end(self, state: str, error: str = "", timeout: float = 10.0) -> None:
        """Publish the last beat (``finished`` or ``failed``), let the peers read it, stop the thread."""
        self._ending = (state, error)
        self._wake.set()
        self.join(timeout)

    # ---- the thread --------------------------------------------------------------------------------------------

    def run(self) -> None:
        """Heartbeat, read, decide, every ``interval`` seconds, until :meth:`end` (or the verdict's exit)."""
        self._sentinel = _open_sentinel(self.address)
        try:
            while self._ending is None:
                try:
                    self._cycle()
                except (StoreGone, SystemExit):
                    raise
                except Exception as error:  # a bug here must not stop the heartbeats (peers would call it dead)
                    self._note(error)
                self._wake.wait(self.interval)
                self._wake.clear()
            self._finish(*self._ending)
        except StoreGone:
            host = self.views[0] if self.rank0_hosts_store else None
            if host is None or host.beat is None or host.beat.state != FINISHED:  # else: rank 0's fit ended
                self._report(store_gone(host, _text(self.address)))
        finally:
            self._ended.set()
            if self._sentinel is not None:
                self._sentinel.close()

    def _cycle(self) -> None:
        now = time.monotonic()
        if not self._fast and self.terminating is not None and self.terminating():
            self._fast = True
        try:
            self._check_sentinel()
            self._beat(RUNNING)
            if self.store.check([VERDICT]):
                self._report(self.store.get(VERDICT).decode())
            everyone = self.rank == 0 or self._fast
            watched = [r for r in range(self.world_size) if everyone or r in (0, self.rank, *self.children)]
            self._read([r for r in watched if r != self.rank], now)
            self._last_ok = now
        except dist.DistError:
            self._check_sentinel()
            if time.monotonic() - self._last_ok > self.dead_after:
                raise StoreGone from None
            return
        self._poll_children()
        dead_after = self.suspect_after if self._fast else self.dead_after
        stall_after = self.stall_after if everyone else None  # the comparison needs every rank's progress
        views = {r: self.views[r] for r in watched}
        verdict = diagnose(views, now, dead_after, stall_after, failed_grace=2 * self.interval)
        if verdict is not None:
            self._report(self.store.compare_set(VERDICT, "", verdict).decode())

    def _note(self, error: Exception) -> None:
        if not self._noted:
            self._noted = True
            print(f"xtl: note: [rank {self.rank}] RankWatchdog: {type(error).__name__}: {error}", file=sys.stderr)
            if debug_enabled():
                traceback.print_exception(error)

    def _beat(self, state: str, error: str = "") -> None:
        self.count += 1
        beat = Beat(self.rank, self.host, os.getpid(), self.count, self.progress(), state, error)
        self.store.set(f"beat/{self.rank}", beat.encode())
        self.views[self.rank].observe(beat, time.monotonic())

    def _read(self, ranks: Sequence[int], now: float) -> None:
        known = [r for r in ranks if self.views[r].beat is not None]
        new = [r for r in ranks if self.views[r].beat is None and self.store.check([f"beat/{r}"])]
        read = known + new
        if read:
            for rank, value in zip(read, self.store.multi_get([f"beat/{r}" for r in read]), strict=True):
                self.views[rank].observe(Beat.decode(value), now)

    def _poll_children(self) -> None:
        for rank, proc in self.children.items():
            code, view = proc.poll(), self.views[rank]
            if code and view.exit_status is None:
                view.exit_status = _exit_status(code)
                if code > 0 and view.failed_at is None:  # an error of its own: it may be this rank's too
                    view.failed_at = time.monotonic()

    def _check_sentinel(self) -> None:
        """Raise :class:`StoreGone` when the store's server closed the sentinel and refuses a new connection."""
        if self._sentinel is None:
            return
        poll = select.poll()  # not select.select: it refuses descriptors past FD_SETSIZE (a long-lived process)
        poll.register(self._sentinel, select.POLLIN | select.POLLHUP | select.POLLERR)
        if not poll.poll(0):
            return
        with contextlib.suppress(OSError):
            if self._sentinel.recv(1, socket.MSG_PEEK):
                return  # the server never writes to it; data is no sign of a close
        self._sentinel.close()
        self._sentinel = _open_sentinel(self.address)
        if self._sentinel is None:
            raise StoreGone

    # ---- leaving ----------------------------------------------------------------------------------------------

    def _finish(self, state: str, error: str) -> None:
        """The last beat; the store's host then waits (bounded) until the others have read it and settled. A rank
        that ends by itself reports nothing (its own error, if any, is the main thread's to raise)."""
        with contextlib.suppress(StoreGone, dist.DistError):
            self._check_sentinel()
            self._beat(state, error)
            if self.hosts_store:
                self._wait_for_peers(self.suspect_after + 2 * self.interval)

    def _report(self, verdict: str) -> None:
        """Print the verdict in one line, flush, let the peers read it, exit with :data:`EXIT_CODE`."""
        if not _REPORTED.acquire(blocking=False):
            return
        if debug_enabled():
            if self.exception is not None:
                traceback.print_exception(self.exception)
            faulthandler.dump_traceback(all_threads=True)
        print(f"xtl: error: {verdict}; exiting so the launcher can restart the job", file=sys.stderr, flush=True)
        _bounded(self.flush, 5.0)
        with contextlib.suppress(StoreGone, dist.DistError):
            self._check_sentinel()
            self._beat(EXITED)
            if self.hosts_store:
                self._wait_for_peers(self.suspect_after + 2 * self.interval)
        if self.kill_children is not None:
            self.kill_children()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_CODE)

    def _wait_for_peers(self, timeout: float) -> None:
        """Keep the store up until every other rank settled (a last beat, or its process ended), or went silent
        for ``suspect_after`` seconds, or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        others = [r for r in range(self.world_size) if r != self.rank]
        while time.monotonic() < deadline:
            now = time.monotonic()
            self._read(others, now)
            self._poll_children()
            if all(self.views[r].settled or now - self.views[r].seen_at > self.suspect_after for r in others):
                return
            time.sleep(min(0.1, self.interval))


def _open_sentinel(address: tuple[str, int] | None) -> socket.socket | None:
    """An idle connection to the store's server (``None`` when it refuses one, or without a TCP store)."""
    if address is None:
        return None
    try:
        sentinel = socket.create_connection(address, timeout=5.0)
    except OSError:
        return None
    sentinel.setblocking(False)
    return sentinel


def _exit_status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _bounded(function: Callable[[], Any] | None, timeout: float) -> None:
    """Run ``function`` in a daemon thread for at most ``timeout`` seconds, ignoring its errors."""
    if function is None:
        return

    def run() -> None:
        with contextlib.suppress(Exception):
            function()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)


def _text(address: tuple[str, int] | None) -> str:
    return f"{address[0]}:{address[1]}" if address else "the default process group's store"


def watch_timeout(interval: float) -> timedelta:
    """The timeout of the watchdog's store connection: one store operation never holds the thread much longer
    than a few heartbeats."""
    return timedelta(seconds=max(5.0, 3 * interval))
