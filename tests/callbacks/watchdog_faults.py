"""Test-only callbacks that break one rank of a run, for the rank watchdog's tests.

Added with ``--trainer.callbacks+='{"class_path": "tests.callbacks.watchdog_faults.KillRank", ...}'`` (the
repository root on ``PYTHONPATH``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import lightning.pytorch as pl


class KillRank(pl.Callback):
    """SIGKILL global rank ``rank`` in the first backward of step ``step``, ``linger_s`` seconds after it began (so
    its last heartbeat shows the step's forward/backward). Writes ``killed_at`` (``time.time()``) next to it first.

    Args:
        step: The ``global_step`` whose first backward kills the rank.
        rank: The global rank that dies.
        linger_s: Seconds to wait before the kill.
        record: A file to write the kill time to.
    """

    def __init__(self, step: int, rank: int, linger_s: float, record: str) -> None:
        self.step = step
        self.rank = rank
        self.linger_s = linger_s
        self.record = record

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        """Die here on the chosen rank and step."""
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            time.sleep(self.linger_s)
            _record(self.record)
            os.kill(os.getpid(), signal.SIGKILL)


class StallData(pl.Callback):
    """Make global rank ``rank``'s training loader hang for good when it reads the batch of step ``step`` (the
    collate function, which runs in the main process without loader workers, sleeps). Writes ``stalled_at``.

    Args:
        step: The ``global_step`` whose batch never comes.
        rank: The global rank whose data loading hangs.
        record: A file to write the time the hang began to.
    """

    def __init__(self, step: int, rank: int, record: str) -> None:
        self.step = step
        self.rank = rank
        self.record = record

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Wrap the loader's collate function (the loader's iterator is made after this hook)."""
        if trainer.global_rank != self.rank:
            return
        loader = trainer.train_dataloader
        collate = loader.collate_fn

        def hanging(samples: Any) -> Any:
            if trainer.global_step == self.step:
                _record(self.record)
                while True:
                    time.sleep(1.0)
            return collate(samples)

        loader.collate_fn = hanging


class RecordWatch(pl.Callback):
    """Write, at the first step, the running threads' names and whether each watchdog of the run watches.

    Args:
        record: The JSON file to write.
    """

    def __init__(self, record: str) -> None:
        self.record = record

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        """Record once."""
        if trainer.global_step == 0:
            watching = [c.watch is not None for c in trainer.callbacks if type(c).__name__ == "RankWatchdog"]
            threads = [t.name for t in threading.enumerate()]
            with open(self.record, "w") as file:
                json.dump({"watching": watching, "threads": threads}, file)


def _record(path: str) -> None:
    with open(path, "w") as file:
        file.write(f"{time.time()}\n")
