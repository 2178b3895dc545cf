"""A thread pool whose threads never hold the process: the pool that runs judger code.

:class:`concurrent.futures.ThreadPoolExecutor` joins its workers when the interpreter exits, so a judger call that
never returns (a hung scoring function, a stuck reward model forward) keeps a finished run alive forever. A
:class:`DaemonThreadPool` runs its calls on daemon threads that nothing joins: a hung call costs its sample (the
judger's time-out fails it) and one of the pool's threads, never the exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class DaemonThreadPool(Executor):
    """Runs submitted calls on up to ``threads`` daemon threads, started as calls arrive.

    Args:
        threads: Calls running at once at most (a hung call holds its thread until it returns).
        name: The threads' name prefix.
    """

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"DaemonThreadPool: threads must be >= 1, got {threads}")
        self.threads = threads
        self.name = name
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple, dict] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)  # released by a thread that finished a call and waits for the next
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` on a pool thread; its future (cancelling it before it starts skips it)."""
        future: Future = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"DaemonThreadPool {self.name}: submit after shutdown")
            self._calls.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._workers) < self.threads:
                worker = threading.Thread(target=self._work, name=f"{self.name}_{len(self._workers)}", daemon=True)
                self._workers.append(worker)
                worker.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking calls; each thread ends after the calls queued before it (``cancel_futures``: those are
        cancelled). Never waits, whatever ``wait`` says: a hung call would hold the caller."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        item = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            for _ in self._workers:
                self._calls.put(None)

    # ---- private ---------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():  # a call cancelled while queued (its time-out passed) is skipped
                try:
                    result = fn(*args, **kwargs)
                except BaseException as err:  # noqa: BLE001 - handed to the caller through the future
                    future.set_exception(err)
                else:
                    future.set_result(result)
            del item, future, fn, args, kwargs  # no reference to the call's result while idle
            self._idle.release()
