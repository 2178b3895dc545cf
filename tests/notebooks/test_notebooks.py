"""Every notebook in ``notebooks/`` executes without error."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
# What each notebook must print (a notebook not listed must print the tiny text model's parity line).
EXPECTED = {"finetune_lora.ipynb": "(within 1e-5: True)", "finetune_tiny_vlm.ipynb": "exact match: "}


class TestNotebooks:
    @pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
    def test_executes(self, path, tmp_path, monkeypatch):
        monkeypatch.setenv("XTL_NOTEBOOK_STEPS", "30")
        notebook = nbformat.read(path, as_version=4)
        NotebookClient(
            notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
        outputs = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs)
        assert EXPECTED.get(path.name, "bitwise equal logits: True") in outputs

    def test_there_is_a_notebook(self):
        assert NOTEBOOKS
