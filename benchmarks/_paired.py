"""The measurement protocol every benchmark in this directory follows.

- Threads are set explicitly (:func:`pin_threads`; default 1 on CPU) before anything is timed.
- The two sides run as pairs after warm-up; the order alternates (A then B, then B then A, ...), so drift of a shared
  machine hits both sides alike (:func:`run_pairs`).
- The result is the median of the per-pair ratios with the min..max spread, printed with both configurations
  (:func:`print_configs`, :meth:`PairedResult.summary`).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MIN_PAIRS = 5


def add_protocol_args(parser: Any, pairs: int = MIN_PAIRS, warmup: int = 1) -> None:
    """Add ``--threads``, ``--pairs`` and ``--warmup`` to an ``argparse`` parser."""
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every timed side (default 1)")
    parser.add_argument("--pairs", type=int, default=pairs, help=f"paired repetitions after warm-up (>= {MIN_PAIRS})")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed pairs before the timed ones")


def pin_threads(threads: int) -> None:
    """Set the thread count of torch and of the OpenMP/MKL pools of this process and of children it spawns."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    try:
        import torch
    except ImportError:  # a stdlib-only parent process: the environment reaches its children
        return
    torch.set_num_threads(threads)


@dataclass
class PairedResult:
    """Per-pair measurements of two sides (``a`` is xtl, ``b`` the peer, unless stated).

    Attributes:
        metric: What each value is (e.g. ``"seconds"``, ``"useful tokens/s"``).
        a: Values of side A, one per timed pair.
        b: Values of side B, in the same pairs.
        higher_is_better: Whether a larger value is better (throughput) or worse (time).
    """

    metric: str
    a: list[float] = field(default_factory=list)
    b: list[float] = field(default_factory=list)
    higher_is_better: bool = False

    @property
    def ratios(self) -> list[float]:
        """A / B per pair."""
        return [x / y for x, y in zip(self.a, self.b)]

    def summary(self, name_a: str = "xtl", name_b: str = "peer") -> str:
        """One line: both medians and the median ratio with its min..max over the pairs."""
        ratios = self.ratios
        return (
            f"{self.metric}: {name_a} median {statistics.median(self.a):.4g} | {name_b} median "
            f"{statistics.median(self.b):.4g} | ratio {name_a}/{name_b} median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f} .. max {max(ratios):.3f}, {len(ratios)} pairs, "
            f"{'higher' if self.higher_is_better else 'lower'} is better)"
        )


def run_pairs(
    side_a: Callable[[], float],
    side_b: Callable[[], float],
    pairs: int,
    warmup: int = 1,
    metric: str = "seconds",
    higher_is_better: bool = False,
    on_pair: Callable[[int, float, float], None] | None = None,
) -> PairedResult:
    """Run ``warmup`` untimed pairs, then ``pairs`` timed ones with the order alternating (A first in even pairs).

    Args:
        side_a: Runs side A once and returns its measurement.
        side_b: Runs side B once and returns its measurement.
        pairs: Timed pairs (at least :data:`MIN_PAIRS`).
        warmup: Untimed pairs run first (same alternation).
        metric: Name of the measurement.
        higher_is_better: Whether larger measurements are better.
        on_pair: Called with ``(index, a, b)`` after each timed pair (progress lines).
    """
    if pairs < MIN_PAIRS:
        raise SystemExit(f"--pairs must be >= {MIN_PAIRS} (got {pairs}): a median of fewer pairs is not a result")
    result = PairedResult(metric, higher_is_better=higher_is_better)
    for i in range(warmup + pairs):
        if i % 2 == 0:
            a, b = side_a(), side_b()
        else:
            b, a = side_b(), side_a()
        if i >= warmup:
            result.a.append(a)
            result.b.append(b)
            if on_pair is not None:
                on_pair(i - warmup, a, b)
    return result


def print_configs(**sides: dict[str, Any]) -> None:
    """Print the exact configuration of every side, one ``name: key=value, ...`` line each."""
    for name, config in sides.items():
        print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in config.items()))


def load_average() -> str:
    """The 1-minute load average (shared machines: printed before and after a run)."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"
