"""Every notebook in ``notebooks/`` executes, shows its plots inline, cleans up what it wrote, and is committed with
its outputs (``python scripts/execute_notebooks.py`` refreshes them). The notebooks of :data:`NBCONVERT` run the way
a reader runs one, ``jupyter nbconvert --to notebook --execute`` (the ``dev`` extra installs it), the others through
nbclient."""

from __future__ import annotations

import subprocess
import sys
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


# Training steps of a notebook's test run (default 10); finetune_tiny's answers end with the template's tokens from
# about 40 steps on (at 10 the model emits newlines): the check of its printed answers needs them
STEPS = {"finetune_tiny.ipynb": 40}
NBCONVERT = {"finetune_tiny.ipynb"}  # one of the quick ones: the command works, at no extra cost
# Notebooks that print sampled answers, as "QUESTION -> 'ANSWER'" lines: the answers hold no token of the template
ANSWERS = {"finetune_tiny.ipynb": " -> "}


def _template_tokens() -> list[str]:
    """The tiny tokenizer's special and added tokens (``<|im_end|>``, ``</think>``, ...)."""
    from transformers import AutoTokenizer

    from xtl.utils import TINY_ASSETS_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_ASSETS_DIR)
    return sorted({*tokenizer.all_special_tokens, *(t.content for t in tokenizer.added_tokens_decoder.values())})


def _assert_clean_answers(path: Path, notebook: nbformat.NotebookNode) -> None:
    marker = ANSWERS.get(path.name)
    if marker is None:
        return
    lines = [line for line in _text(notebook).splitlines() if marker in line]
    assert lines, f"{path.name} prints no answers"
    tokens = _template_tokens()
    for line in lines:
        answer = line.split(marker, 1)[1]
        assert not [t for t in tokens if t in answer], f"{path.name}: a template token in the answer {line!r}"


def _nbconvert(notebook: nbformat.NotebookNode, work: Path) -> nbformat.NotebookNode:
    """``notebook`` executed by ``jupyter nbconvert --to notebook --execute`` with ``work`` as the kernel's working
    directory (nbconvert's: the notebook's folder; the notebook is removed from it after, the executed copy is
    written outside it)."""
    source = work / "notebook.ipynb"
    nbformat.write(notebook, source)
    with tempfile.TemporaryDirectory() as out:
        command = [
            str(Path(sys.executable).parent / "jupyter"), "nbconvert", "--to", "notebook", "--execute", str(source),
            "--output-dir", out, "--ExecutePreprocessor.timeout=600", "--ExecutePreprocessor.kernel_name=python3",
        ]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True)
        source.unlink()
        assert proc.returncode == 0, proc.stderr[-3000:]
        return nbformat.read(Path(out) / source.name, as_version=4)


def _text(notebook: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))


def _images(notebook: nbformat.NotebookNode) -> int:
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    return sum("image/png" in o.get("data", {}) for o in outputs)


class TestNotebooks:
    @pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
    def test_executes_plots_inline_and_cleans_up(self, path, tmp_path, monkeypatch):
        monkeypatch.setenv("XTL_NOTEBOOK_STEPS", str(STEPS.get(path.name, 10)))
        temp = Path(tempfile.gettempdir())
        before = set(temp.glob("xtl_*"))
        notebook = nbformat.read(path, as_version=4)
        for cell in notebook.cells:
            cell.pop("outputs", None) if cell.cell_type != "code" else cell.update(outputs=[], execution_count=None)
        if path.name in NBCONVERT:
            notebook = _nbconvert(notebook, tmp_path)
        else:
            NotebookClient(
                notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
            ).execute()
        assert EXPECTED.get(path.name, "bitwise equal logits: True") in _text(notebook)
        _assert_clean_answers(path, notebook)
        assert _images(notebook) >= 1, "a plot is displayed inline"
        assert not any(tmp_path.iterdir()), f"written in the working directory: {sorted(tmp_path.iterdir())}"
        assert set(temp.glob("xtl_*")) <= before, "the notebook removes its temporary folder"

    @pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
    def test_is_committed_with_its_outputs(self, path):
        notebook = nbformat.read(path, as_version=4)
        code = [c for c in notebook.cells if c.cell_type == "code"]
        assert all(c.execution_count is not None for c in code), "every code cell was run"
        assert EXPECTED.get(path.name, "bitwise equal logits: True") in _text(notebook)
        _assert_clean_answers(path, notebook)
        assert _images(notebook) >= 1

    def test_there_is_a_notebook(self):
        assert NOTEBOOKS
