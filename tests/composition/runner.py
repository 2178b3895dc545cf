"""Run composition-matrix cells one after another in this process (and its peers, for a distributed strategy).

``python -m tests.composition.runner SPEC.json``; the spec names the cells (and other ``xtl fit`` runs), the work
and data-cache folders and the results file. Started with ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` in the
environment, the processes form one gloo group first and every cell's trainer reuses it, so many distributed cells
share one start-up. Each rank writes its results after each cell (a crash keeps what was done); rank 0's also hold
what the run wrote (losses, the probe).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.composition.matrix import cells
from xtl.command import main
from xtl.utils import atomic_write_bytes

PROBE = "trainer:\n  callbacks+:\n    - class_path: tests.composition.probe.Probe\n"


def run_cells(spec: dict) -> dict[str, dict]:
    """Run the cells of ``spec`` in order; returns ``cell id -> result`` (see :func:`run_cell`)."""
    rank = int(os.environ.get("RANK", "0"))
    work = Path(spec["work"])
    config_dir = work / f"configs_rank{rank}"
    config_dir.mkdir(parents=True, exist_ok=True)
    probe = config_dir / "probe.yaml"
    probe.write_text(PROBE)
    by_id = {cell.id: cell for cell in cells()}
    # matrix cells by id, then free-form runs: id -> (arguments after ``fit``, the run's root folder)
    runs = {cell_id: (by_id[cell_id].configs(config_dir, work / cell_id), work / cell_id) for cell_id in spec["cells"]}
    runs.update({run_id: (args, Path(root)) for run_id, (args, root) in spec.get("runs", {}).items()})
    results: dict[str, dict] = {}
    for cell_id, (configs, run_dir) in runs.items():
        args = ["fit", *configs, "--config", str(probe), "--data.cache_dir", spec["cache"]]
        results[cell_id] = run_cell(args, run_dir)
        out = Path(spec["out"])
        atomic_write_bytes(out if rank == 0 else out.with_suffix(f".rank{rank}.json"), json.dumps(results).encode())
    return results


def run_cell(args: list[str], run_dir: Path) -> dict:
    """``xtl fit args`` in this process.

    Returns:
        ``rc`` (the exit code; ``-1`` for an exception that escaped ``xtl``), ``stderr`` (what xtl printed there),
        ``traceback`` (of an escaped exception), ``seconds`` (its wall time), ``losses`` (``train/loss`` per step as
        logged) and ``probe`` (what :class:`tests.composition.probe.Probe` recorded).
    """
    result: dict = {"traceback": None}
    start = time.perf_counter()
    with _captured_stderr() as err:
        try:
            result["rc"] = main(args)
        except SystemExit as exit_:
            result["rc"] = int(exit_.code or 0)
        except Exception:  # a bug: recorded for the test to show, the next cell still runs
            result["rc"] = -1
            result["traceback"] = traceback.format_exc()[-6000:]
    result["stderr"] = err["text"][-8000:]
    result["seconds"] = round(time.perf_counter() - start, 2)
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 reads the run's files once they are complete
        return result
    metrics = sorted(run_dir.glob("logs/version_*/metrics.csv"))
    rows = list(csv.DictReader(metrics[-1].open())) if metrics else []
    result["losses"] = {row["step"]: row["train/loss"] for row in rows if row.get("train/loss")}
    result["logged"] = sorted({key for row in rows for key, value in row.items() if value})
    probe = run_dir / "probe.json"
    result["probe"] = json.loads(probe.read_text()) if probe.is_file() else None
    return result


@contextlib.contextmanager
def _captured_stderr() -> Iterator[dict[str, str]]:
    """``{"text": ...}``: everything written to file descriptor 2 meanwhile (Python, torch's C++ and the logging
    handlers alike), filled in on exit."""
    sys.stderr.flush()
    saved = os.dup(2)
    captured = {"text": ""}
    with tempfile.TemporaryFile("w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured["text"] = sink.read().decode(errors="replace")


if __name__ == "__main__":
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    sys.argv = sys.argv[:1]  # the cells' arguments go to xtl's main, not through the command line
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=spec.get("timeout", 120)))
    run_cells(spec)
    if dist.is_initialized():
        dist.destroy_process_group()
