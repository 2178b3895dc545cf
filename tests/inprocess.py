"""Run an ``xtl`` command in the test's own process, as a new process would run it, with what it prints.

A new Python process spends several seconds importing before it does anything; a one-process run in the test's process
does not. Runs of more than one process (a second rank re-runs the command line) still need processes of their own.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from xtl.command import main


def run_in_process(args: list[str], cwd: Path) -> tuple[int, str]:
    """``xtl args`` run in this process from ``cwd``: the exit code and everything written to standard output and
    error meanwhile (file descriptors 1 and 2, Python's streams and the console handlers of the loggers)."""
    previous = Path.cwd()
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    consoles = [h for lg in loggers for h in getattr(lg, "handlers", ()) if type(h) is logging.StreamHandler]
    with tempfile.TemporaryFile("w+b") as sink, open(os.dup(sink.fileno()), "w", closefd=True) as text:
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in saved:
            os.dup2(sink.fileno(), fd)
        streams = [handler.stream for handler in consoles]  # swapped as is: an earlier test's may be closed
        for handler in consoles:
            handler.stream = text
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                try:
                    code = main(args)
                except SystemExit as exit_:
                    code = int(exit_.code or 0)
                except Exception:  # a bug: shown by the caller's assertion
                    code = -1
                    text.write(traceback.format_exc())
        finally:
            text.flush()
            os.chdir(previous)
            for handler, stream in zip(consoles, streams):
                handler.stream = stream
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
        sink.seek(0)
        return code, sink.read().decode(errors="replace")


def run_fit(args: list[str], cwd: Path, processes: bool = False) -> tuple[dict[int, dict[str, float]], str]:
    """``xtl args`` (a fit) from ``cwd``, which must succeed without a traceback: the rows of its ``metrics.csv``
    logs that have a ``train/loss``, by step, and its output.

    Args:
        args: The command line after ``xtl``.
        cwd: Where it runs (its ``runs/`` holds the logs).
        processes: Run it as a process of its own (a run of several ranks: a second rank re-runs the command line;
            the repository is on its ``PYTHONPATH``, so YAML may name ``tests`` functions); else in this process.
    """
    if processes:
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
        proc = subprocess.run(
            [sys.executable, "-m", "xtl", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
        )
        code, output = proc.returncode, proc.stdout + proc.stderr
    else:  # in this process (a new one would spend most of the run importing)
        code, output = run_in_process(args, cwd)
    assert code == 0, output[-4000:]
    assert "Traceback" not in output
    rows: dict[int, dict[str, float]] = {}
    for metrics in sorted(cwd.glob("runs/*/logs/version_*/metrics.csv")):
        for row in csv.DictReader(metrics.open()):
            if row.get("train/loss"):
                rows[int(row["step"])] = {k: float(v) for k, v in row.items() if v}
    return rows, output
