"""Ctrl-C and SIGTERM during a fit: stop at the next step boundary, after :class:`~xtl.callbacks.TrainingCheckpoint`
has saved ``last`` at the step reached.

The first SIGINT or SIGTERM only records the request (and rank 0 says so in one line); the training step in
progress finishes. At the next optimizer-step boundary every rank takes part in one all-reduce that agrees whether
any rank was signalled, so all of them stop at the same step and all reach the checkpoint save (a collective DCP
save under FSDP) -- not only rank 0's signal counts, and no collective runs inside a signal handler (Lightning's
SIGTERM handler broadcasts from there, which can interleave with a collective the main thread is in; it is replaced
while the fit trains). The fit then exits with :class:`Interrupted` (``128 + signal``: 130 for SIGINT, 143 for
SIGTERM, the codes a shell gives a process the signal ended, so a launcher or script sees an interruption, not a
success). A second Ctrl-C aborts at once, without saving (Lightning's ``KeyboardInterrupt`` handling, exit 1).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import weakref
from collections.abc import Hashable
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_REQUESTS: weakref.WeakKeyDictionary[pl.Trainer, StopRequest] = weakref.WeakKeyDictionary()


class Interrupted(SystemExit):
    """The fit stopped on a signal once ``last`` was saved; the exit code is ``128 + signal``.

    Args:
        signum: The signal (SIGINT or SIGTERM).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class StopRequest:
    """The signal handlers of one fit and the stop they request.

    Args:
        trainer: The fitting trainer (its step and rank for the message).
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.signum: int | None = None  # the first signal this process got
        self.announced = False  # rank 0 said it is stopping
        self._previous: dict[int, Any] = {}
        self._agreed: tuple[Hashable, int] | None = None  # (boundary, agreed signal or 0)

    @classmethod
    def install(cls, trainer: pl.Trainer) -> StopRequest | None:
        """Handle SIGINT and SIGTERM for ``trainer``'s fit (from the main thread only; ``None`` elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        request = cls(trainer)
        for signum in SIGNALS:
            request._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, request._handle)
        _REQUESTS[trainer] = request
        return request

    def uninstall(self) -> None:
        """Give the signals back to the handlers they had (where this one is still installed)."""
        previous, self._previous = self._previous, {}
        if _REQUESTS.get(self.trainer) is self:
            del _REQUESTS[self.trainer]
        for signum, handler in previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, handler)

    def agree(self, trainer: pl.Trainer, boundary: Hashable) -> int | None:
        """At a boundary between steps every rank reaches (``boundary`` names it), the signal any rank got, or
        ``None``; one all-reduce per boundary (callers after the first get its answer)."""
        if self._agreed is not None and self._agreed[0] == boundary:
            return self._agreed[1] or None
        agreed = self.signum or 0
        group = trainer.lightning_module.parallelizer.world_group()  # None: one rank
        if group is not None:
            flag = torch.tensor([agreed], dtype=torch.int32, device=trainer.strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # SIGTERM (15) wins over SIGINT (2)
            agreed = int(flag.item())
        self._agreed = (boundary, agreed)
        if agreed and trainer.is_global_zero and not self.announced:  # another rank got it
            self.announced = True
            name = signal.Signals(agreed).name
            write_line(f"xtl: interrupted ({name} on another rank) at step {trainer.global_step}; saving last.ckpt")
        return agreed or None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            if self.trainer.is_global_zero:
                self.announced = True
                hint = " (Ctrl-C again: stop at once, without saving)" if signum == signal.SIGINT else ""
                write_line(
                    f"xtl: interrupted ({signal.Signals(signum).name}) at step {self.trainer.global_step}; saving "
                    f"last.ckpt after the step in progress{hint}"
                )
            return
        if signum == signal.SIGINT:  # the second Ctrl-C: stop now, without saving
            self.uninstall()
            raise KeyboardInterrupt


def requested_signal(trainer: pl.Trainer) -> int | None:
    """The signal that asked ``trainer``'s fit to stop in this process, or ``None``."""
    request = _REQUESTS.get(trainer)
    return None if request is None else request.signum


def write_line(line: str) -> None:
    """Print one line on stderr; also from a signal handler, which may interrupt a write to stderr in progress
    (Python's buffered stream then refuses a reentrant write: the line goes to file descriptor 2 directly)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except RuntimeError:
        os.write(2, f"{line}\n".encode())
