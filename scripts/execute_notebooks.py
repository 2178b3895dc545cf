"""Run every notebook in ``notebooks/`` with its default settings and save it with its outputs.

    python scripts/execute_notebooks.py [NAME.ipynb ...]

The notebooks are committed with their outputs (plots, answers, the parity lines) so that a reader sees them
without running anything; the test suite runs them again (fewer steps) and checks that they still work.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute(path: Path) -> None:
    """Execute ``path`` in a temporary working directory and write it back with its outputs."""
    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as work:
        NotebookClient(notebook, timeout=1800, kernel_name="python3", resources={"metadata": {"path": work}}).execute()
    nbformat.write(notebook, path)
    print(f"executed {path}")


def main(names: list[str]) -> int:
    """Execute the named notebooks (default: all)."""
    paths = [NOTEBOOKS / name for name in names] if names else sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        execute(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
