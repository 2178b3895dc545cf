"""Dead and hung ranks, named in seconds: a heartbeat watchdog over the process group's store.

A rank that dies leaves its peers in a collective: on gloo they end with a raw traceback, on NCCL they wait until
the collective times out (30 minutes). A rank stuck in its data loader, or in a collective the others never join,
hangs the job as long. :class:`RankWatchdog` ends every surviving rank within seconds with one line that names the
rank, its host and process, and the last step it was in, and an exit code (:data:`EXIT_CODE`, 75) that makes the
launcher (torchrun ``--max-restarts``, a SLURM requeue) restart the job, which then resumes by itself
(``--ckpt_path auto``).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from subprocess import Popen
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed import distributed_c10d

from xtl.callbacks._heartbeats import FAILED, FINISHED, Progress
from xtl.callbacks._interrupt import requested_signal
from xtl.callbacks._watchdog_thread import EXIT_CODE, PREFIX, Watch, watch_timeout
from xtl.errors import ConfigError

__all__ = ["EXIT_CODE", "RankWatchdog"]

_KEY = "trainer.callbacks[xtl.callbacks.RankWatchdog].init_args"
# what a collective that lost a peer raises: torch's distributed errors, gloo's and NCCL's runtime errors
_PEER_FAILURE_WORDS = ("gloo", "nccl", "connection closed by peer", "connection reset by peer", "broken pipe")


class RankWatchdog(pl.Callback):
    """Detects a rank that died or stalls, names it on every surviving rank in one line, and exits non-zero.

    Every rank's background thread publishes a heartbeat every ``interval_s`` seconds through the default process
    group's store: its host, pid, and the phase its main thread is in (``data loading step 12``,
    ``forward/backward step 12``, ``optimizer step 12``, ``checkpoint save step 12``, ``validation after step 12``;
    ``step N`` counts the optimizer steps completed before it, as ``trainer.global_step`` and checkpoint names do).
    The phase is updated by this callback's hooks (an attribute assignment on the main thread; no store traffic
    from the step). Every surviving rank ends with one line, ``xtl: error: rank 1 (host nodeA, pid 1234) stopped
    heartbeating 61 s ago; its last step: forward/backward step 5; exiting so the launcher can restart the job``,
    and exit code :data:`EXIT_CODE`, when:

    - a rank's heartbeat is older than ``dead_after_s`` (a dead process or host; rank 0's death also closes the
      store it hosts under Lightning's and SLURM's launch: named at once);
    - a collective of this rank failed (gloo raises at once when a peer dies), or torchrun's agent sent SIGTERM
      (it stops the other ranks when one dies): the rank whose heartbeat is then ``3 * interval_s`` old is named,
      instead of gloo's traceback (a SIGTERM with every rank alive names none: the ranks save ``last`` at the next
      step boundary and exit 143, see :class:`~xtl.callbacks.TrainingCheckpoint`);
    - a rank that Lightning's launcher started on this node ended: named at once;
    - a rank failed with an error of its own: its peers name it and its error;
    - the ranks that are behind all others made no progress for ``stall_timeout_s`` (a stuck data read, a
      deadlocked collective): they are named with their phase (the others wait in a collective for them).

    ``XTL_DEBUG=1`` adds the tracebacks (the failed collective's, and every thread's stack of the reporting rank).
    Inert on one process. The ``xtl fit`` command adds one with these defaults unless the config has one;
    ``enabled: false`` turns it off.

    Args:
        enabled: Watch (``false``: no thread, no store traffic).
        interval_s: Seconds between heartbeats (and between rank 0's reads of every rank's).
        dead_after_s: Seconds without a heartbeat after which a rank is dead. The default tolerates 30 missed beats
            (a process frozen by swapping, a long call that holds Python's lock) and is still far below NCCL's
            collective time-out.
        stall_timeout_s: Seconds without progress after which the ranks behind are named (``null``: never). The
            default is below the process group's 30-minute collective time-out (so the stalled rank is named before
            the collectives time out) and above what one phase takes on a real cluster (a checkpoint save, the
            first step's compilation, a validation pass); raise both together for longer phases.
    """

    def __init__(
        self,
        enabled: bool = True,
        interval_s: float = 2.0,
        dead_after_s: float = 60.0,
        stall_timeout_s: float | None = 1500.0,
    ) -> None:
        if interval_s <= 0:
            raise ConfigError(f"{_KEY}.interval_s is {interval_s}: give a positive number of seconds")
        if dead_after_s < 3 * interval_s:
            raise ConfigError(
                f"{_KEY}.dead_after_s is {dead_after_s}: give at least 3 heartbeat intervals (3 * interval_s = "
                f"{3 * interval_s}), or a live rank that misses one beat counts as dead"
            )
        if stall_timeout_s is not None and stall_timeout_s < 3 * interval_s:
            raise ConfigError(
                f"{_KEY}.stall_timeout_s is {stall_timeout_s}: give at least 3 heartbeat intervals (3 * interval_s ="
                f" {3 * interval_s}), or null to never name stalled ranks"
            )
        self.enabled = enabled
        self.interval_s = interval_s
        self.dead_after_s = dead_after_s
        self.stall_timeout_s = stall_timeout_s
        self.watch: Watch | None = None
        self.progress = Progress()
        self._observer: tuple[_ChildProcessObserver, list[Popen]] | None = None

    # ---- start and stop --------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Start the heartbeat thread when the run has more than one process."""
        distributed = dist.is_available() and dist.is_initialized() and trainer.world_size > 1
        if not self.enabled or self.watch is not None or not distributed:
            return
        store = _default_store(self.interval_s)
        if store is None:
            return
        self.progress = Progress(trainer.global_step)
        launcher = trainer.strategy.launcher
        children: dict[int, Popen] = {}
        kill = None
        if isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
            first = trainer.node_rank * launcher.num_processes
            children = {first + i + 1: proc for i, proc in enumerate(launcher.procs)}
            kill = functools.partial(launcher.kill, signal.SIGKILL)
            self._quiet_lightning_observer()
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self.watch = Watch(
            store=store,
            address=_address(store),
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            progress=lambda: self.progress,
            interval=self.interval_s,
            dead_after=self.dead_after_s,
            stall_after=self.stall_timeout_s,
            hosts_store=trainer.global_rank == 0 and not agent_store,
            rank0_hosts_store=not agent_store,
            children=children,
            kill_children=kill,
            flush=lambda: [logger.save() for logger in trainer.loggers],
            terminating=lambda: trainer.received_sigterm or requested_signal(trainer) == signal.SIGTERM,
        )
        self.watch.start()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Publish ``finished`` and stop the thread (rank 0 first lets the others finish reading its store)."""
        self._stop(FINISHED)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A collective that lost a peer: name the dead rank and exit (:data:`EXIT_CODE`) instead of raising;
        another error of this rank: publish it (the peers name this rank and its error) and let it raise."""
        watch = self.watch
        if watch is None:
            return
        if not isinstance(exception, Exception):  # Ctrl-C, SystemExit: every rank stops; nothing to name
            self._stop(FINISHED)
            return
        if _lost_a_peer(exception):
            watch.suspect(exception, timeout=watch.suspect_after + 3 * self.interval_s)
        first_line = (str(exception).strip().splitlines() or [""])[0][:300]
        self._stop(FAILED, f"{type(exception).__name__}: {first_line}")

    def _stop(self, state: str, error: str = "") -> None:
        watch, self.watch = self.watch, None
        if watch is None:
            return
        watch.end(state, error, timeout=self.dead_after_s + 5 * self.interval_s)
        if self._observer is not None:  # Lightning's observer looks after the launched ranks again
            observer, procs = self._observer
            observer._child_processes = procs
            self._observer = None

    def _quiet_lightning_observer(self) -> None:
        """Lightning's launcher watches the ranks it started and SIGKILLs this process within 5 s of one's death,
        before anyone could say which rank died: while the watchdog runs, it does that job (it names the rank, then
        kills the ranks left)."""
        for thread in threading.enumerate():
            if isinstance(thread, _ChildProcessObserver) and "_child_processes" in vars(thread):
                self._observer = (thread, thread._child_processes)
                thread._child_processes = []

    # ---- phases ------------------------------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The first batch is being read."""
        self._enter("data loading", trainer)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        """The step's batch is here: forward and backward."""
        self._enter("forward/backward", trainer)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        """One more micro-batch's backward."""
        if self.watch is not None:
            self.progress = self.progress.advance()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Gradients are reduced: the optimizer steps."""
        self._enter("optimizer", trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        """The next step's batch is being read (Lightning fetches it before the next ``on_train_batch_start``)."""
        self._enter("data loading", trainer)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        """A checkpoint is being gathered and written."""
        self._enter("checkpoint save", trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Validation runs."""
        self._enter("validation after", trainer)

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        """One more validation batch."""
        if self.watch is not None:
            self.progress = self.progress.advance()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Training goes on: the next batch is being read."""
        if trainer.state.fn == TrainerFn.FITTING:
            self._enter("data loading", trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The last steps are done."""
        if self.watch is not None:
            self.progress = self.progress.enter("training end", trainer.global_step)

    def _enter(self, name: str, trainer: pl.Trainer) -> None:
        if self.watch is not None:
            step = trainer.global_step
            self.progress = self.progress.enter(f"{name} step {step}", step)


def _default_store(interval: float) -> dist.Store | None:
    """The watchdog's own connection to the default process group's store, under ``xtl/watchdog/`` (``None``, with
    a note, where this torch has no way to reach it)."""
    if not hasattr(distributed_c10d, "_get_default_store"):
        print(
            "xtl: note: RankWatchdog is off: this torch has no torch.distributed.distributed_c10d._get_default_store "
            "to reach the process group's store; dead or stalled ranks are not named",
            file=sys.stderr,
        )
        return None
    store = distributed_c10d._get_default_store().clone()
    store.set_timeout(watch_timeout(interval))
    return dist.PrefixStore(PREFIX, store)


def _address(store: dist.Store) -> tuple[str, int] | None:
    """``(host, port)`` of the TCP store under ``store``'s prefixes (``None`` for another kind of store)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return (store.host, store.port) if isinstance(store, dist.TCPStore) else None


def _lost_a_peer(exception: BaseException) -> bool:
    """Whether ``exception`` (or one it was raised from) is a collective's failure to reach a peer."""
    seen: set[int] = set()
    while exception is not None and id(exception) not in seen:
        seen.add(id(exception))
        if isinstance(exception, dist.DistError):
            return True
        if isinstance(exception, RuntimeError) and any(w in str(exception).lower() for w in _PEER_FAILURE_WORDS):
            return True
        exception = exception.__cause__ or exception.__context__
    return False
