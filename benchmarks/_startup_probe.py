"""A callback for ``benchmarks/startup.py``: stamps the wall clock at the first training step, then ends the process.

``XTL_STARTUP_PROBE`` names the file it writes: one line, ``<time at step 1 start> <time at step 1 end> <CPU
seconds of this process at step 1 start>`` (``time.time()`` / ``time.process_time()``), written to a temporary
name and renamed. The process then exits at once (code 0): what follows the first step (more steps, teardown) is
not start-up.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback


class FirstStepProbe(Callback):
    """Records when the first training batch starts and when it ends, then exits the process."""

    def __init__(self) -> None:
        self._start = 0.0
        self._cpu = 0.0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Stamp the start of the first step."""
        if not self._start:
            self._start = time.time()
            self._cpu = time.process_time()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Stamp the end of the first step, write both stamps and exit."""
        end = time.time()
        path = Path(os.environ["XTL_STARTUP_PROBE"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{self._start} {end} {self._cpu}\n")
        tmp.rename(path)
        os._exit(0)
