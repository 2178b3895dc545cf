"""Every notebook in ``notebooks/`` executes, shows its plots inline, cleans up what it wrote, and is committed with
its outputs (``python scripts/execute_notebooks.py`` refreshes them)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
# What each notebook must print (a notebook not listed must print the tiny text model's parity line).
EXPECTED = {
    "finetune_lora.ipynb": "(within 1e-5: True)",
    "finetune_tiny_vlm.ipynb": "exact match: ",
    "rl_tiny_agent.ipynb": "held-out exact match with tools: SFT ",
    "rl_tiny_grpo.ipynb": "held-out exact match: SFT ",
}


def _text(notebook: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))


def _images(notebook: nbformat.NotebookNode) -> int:
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    return sum("image/png" in o.get("data", {}) for o in outputs)


class TestNotebooks:
    @pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
    def test_executes_plots_inline_and_cleans_up(self, path, tmp_path, monkeypatch):
        monkeypatch.setenv("XTL_NOTEBOOK_STEPS", "10")
        temp = Path(tempfile.gettempdir())
        before = set(temp.glob("xtl_*"))
        notebook = nbformat.read(path, as_version=4)
        for cell in notebook.cells:
            cell.pop("outputs", None) if cell.cell_type != "code" else cell.update(outputs=[], execution_count=None)
        NotebookClient(
            notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
        assert EXPECTED.get(path.name, "bitwise equal logits: True") in _text(notebook)
        assert _images(notebook) >= 1, "a plot is displayed inline"
        assert not any(tmp_path.iterdir()), f"written in the working directory: {sorted(tmp_path.iterdir())}"
        assert set(temp.glob("xtl_*")) <= before, "the notebook removes its temporary folder"

    @pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
    def test_is_committed_with_its_outputs(self, path):
        notebook = nbformat.read(path, as_version=4)
        code = [c for c in notebook.cells if c.cell_type == "code"]
        assert all(c.execution_count is not None for c in code), "every code cell was run"
        assert EXPECTED.get(path.name, "bitwise equal logits: True") in _text(notebook)
        assert _images(notebook) >= 1

    def test_there_is_a_notebook(self):
        assert NOTEBOOKS
