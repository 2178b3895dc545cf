"""Start-up cost of the ``xtl`` command against the floor of importing Lightning, on the same machine.

Usage::

    python benchmarks/startup.py [--recipe configs/tiny_sft.yaml --pairs 5 --warmup 1 --threads 1]

Every measurement is a fresh process (the interpreter's own start included on every side), timed by this
stdlib-only parent from just before the process is spawned:

- ``floor``: ``python -c "import lightning"``, the import every Lightning trainer pays;
- ``xtl --help``: the command's help (no Lightning import);
- ``xtl fit --help``: the Lightning subcommand's help (its parser over the model and data classes);
- ``first step``: ``xtl fit --config RECIPE`` until its first training step starts and until it ends (a
  callback, ``benchmarks/_startup_probe.py``, stamps both and ends the process), with the progress bar off, a fresh
  ``default_root_dir`` per run and a warm tokenization cache (the warm-up run builds it), so what is measured is
  what a re-run of a recipe pays before it trains.

Protocol (``benchmarks/_paired.py``): threads pinned (``--threads``, default 1), ``--warmup`` untimed rounds, then
``--pairs`` (>= 5) rounds in which the floor and the xtl commands run in alternating order. Printed per command:
the median seconds with min..max, and the median difference to the floor of the same round with its min..max.
The acceptance target is the time to the first step within 1 s of the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _paired import MIN_PAIRS, add_protocol_args, load_average, pin_threads

ROOT = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 1.0


def main() -> None:
    """Run the rounds and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "configs" / "tiny_sft.yaml"), help="recipe for `xtl fit`")
    add_protocol_args(parser)
    args = parser.parse_args()
    if args.pairs < MIN_PAIRS:
        parser.error(f"--pairs must be >= {MIN_PAIRS}")
    pin_threads(args.threads)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    xtl = [sys.executable, "-m", "xtl"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        commands = {
            "floor": ([sys.executable, "-c", "import lightning"], None),
            "xtl --help": ([*xtl, "--help"], None),
            "xtl fit --help": ([*xtl, "fit", "--help"], None),
            "first step": (_fit_command(xtl, args.recipe, work), work / "probe"),
        }
        print(f"python: {sys.executable} ({sys.version.split()[0]}); threads={args.threads}; load {load_average()}")
        for name, (cmd, _) in commands.items():
            print(f"{name}: {' '.join(cmd)}")
        wall: dict[str, list[float]] = {name: [] for name in commands}
        cpu: dict[str, list[float]] = {name: [] for name in commands}
        step_end: list[float] = []
        for i in range(args.warmup + args.pairs):
            names = list(commands) if i % 2 == 0 else list(reversed(commands))
            for name in names:
                cmd, probe = commands[name]
                run = _run(cmd, env, probe, work / f"run{i}")
                if i >= args.warmup:
                    wall[name].append(run[0])
                    cpu[name].append(run[1])
                    if run[2] is not None:
                        step_end.append(run[2])
        print(f"load after: {load_average()}")
    for clock, values in _clocks(wall, cpu):
        print(
            f"{clock} seconds"
            + (" (user + system time of the process: steady on a shared machine)" if clock == "CPU" else "")
        )
        for name in commands:
            print(f"  {name:>14}: {_spread(values[name])}" + _minus_floor(values[name], values["floor"], name))
    print(f"  first step end (wall, its own compute included): {_spread(step_end)}")
    gaps = {clock: statistics.median(_diff(v["first step"], v["floor"])) for clock, v in _clocks(wall, cpu)}
    verdict = "within" if max(gaps.values()) <= TARGET_SECONDS else "NOT within"
    print(
        f"time to the first step is {verdict} {TARGET_SECONDS:.0f} s of the Lightning import floor "
        f"(wall {gaps['wall']:+.2f} s, CPU {gaps['CPU']:+.2f} s)"
    )


def _clocks(wall: dict[str, list[float]], cpu: dict[str, list[float]]) -> list[tuple[str, dict[str, list[float]]]]:
    """Both clocks' measurements, named."""
    return [("wall", wall), ("CPU", cpu)]


def _fit_command(xtl: list[str], recipe: str, work: Path) -> list[str]:
    return [
        *xtl,
        "fit",
        "--config",
        recipe,
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.callbacks+=_startup_probe.FirstStepProbe",
        "--data.cache_dir",
        str(work / "cache"),
    ]


def _run(cmd: list[str], env: dict[str, str], probe: Path | None, root: Path) -> tuple[float, float, float | None]:
    """Wall and CPU seconds of one command to its exit (or its first step's start), and to its first step's end."""
    if probe is not None:
        cmd = [*cmd, "--trainer.default_root_dir", str(root)]
        env = dict(env, XTL_STARTUP_PROBE=str(probe))
        probe.unlink(missing_ok=True)
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read() if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    if probe is None:
        return wall, usage.ru_utime + usage.ru_stime, None
    step_start, step_end, step_cpu = (float(x) for x in probe.read_text().split())
    return step_start - start, step_cpu, step_end - start


def _diff(values: list[float], floor: list[float]) -> list[float]:
    return [v - f for v, f in zip(values, floor)]


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} s (min {min(values):.2f} .. max {max(values):.2f})"


def _minus_floor(values: list[float], floor: list[float], name: str) -> str:
    if name == "floor":
        return ""
    diff = _diff(values, floor)
    return f"; minus floor {statistics.median(diff):+.2f} s (min {min(diff):+.2f} .. max {max(diff):+.2f})"


if __name__ == "__main__":
    main()
