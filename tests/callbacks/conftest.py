"""Fixtures of the memory/speed callback tests: tiny CLI runs, cached per recipe and fragment list."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli.test_cli import ROOT, _run_main, _tiny_args

COUNTER = "trainer:\n  callbacks+:\n    - class_path: tests.callbacks.helpers.ForwardCounter\n"


@dataclass
class TinyRun:
    """What a tiny CLI run logged: ``metrics.csv`` rows with a ``train/loss``, the attention calls per layer, every
    logged row, and the run folder."""

    rows: list[dict[str, str]]
    forward_calls: list[int]
    logged: list[dict[str, str]]
    root: Path

    def column(self, key: str) -> list[str]:
        """The logged strings of ``key``, one per step."""
        return [row[key] for row in self.rows]


@contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@pytest.fixture(scope="session")
def tiny_fit(data_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., TinyRun]:
    """Factory ``tiny_fit(recipe, *fragments, steps=3)``: run ``xtl fit`` on a tiny recipe with the fragments
    (paths or YAML text) and a :class:`~tests.callbacks.helpers.ForwardCounter`; cached, so a baseline runs once
    per session."""
    cache: dict[tuple, TinyRun] = {}

    def fit(recipe: str, *fragments: Path | str, steps: int = 3) -> TinyRun:
        key = (recipe, fragments, steps)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(Path(recipe).stem)
            configs = []
            for i, fragment in enumerate((*fragments, COUNTER)):
                if isinstance(fragment, str):
                    path = run_dir / f"fragment_{i}.yaml"
                    path.write_text(fragment)
                    fragment = path
                configs += ["--config", str(fragment)]
            args = ["fit", *_tiny_args(ROOT / "configs" / recipe, data_cache, *configs), "--trainer.max_steps"]
            with _cwd(run_dir):
                assert _run_main([*args, str(steps)]) == 0
            metrics = next(run_dir.glob("runs/*/logs/version_*/metrics.csv"))
            logged = list(csv.DictReader(metrics.open()))
            rows = [row for row in logged if row.get("train/loss")]
            calls = json.loads((run_dir / "forward_calls.json").read_text())
            cache[key] = TinyRun(rows, calls, logged, metrics.parents[2])
        return cache[key]

    return fit
