"""The documented commands work as written: every command block of README.md and docs/*.md marked ``doctest`` runs,
in the order a reader meets it, with tiny stand-ins where a doc names a real model or file.

A block is marked in its info string: ```` ```bash doctest ```` (runs, exit 0, no traceback) or ```` ```bash
doctest=gpu ```` (a GPU recipe: on a machine without a GPU it must stop at once with xtl's one-line message saying
so, exit 2). Each document runs in a fresh folder of its own (``configs/`` and ``callbacks/`` linked in), as a new
reader would follow it. Setup commands (``python3 -m venv``, ``. .venv/bin/activate``, ``pip install``) are the
environment the suite already runs in, and are skipped.

Stand-ins (:class:`StandIns`): a tiny HF model directory for ``path/to/hf_model`` and ``/models/...``, the tiny SFT
set for ``/data/sft.jsonl``, tiny bf16 / fp8 / extra-tensor checkpoints for the ``xtl convert`` examples, a prompt
file; ``xtl fit`` gets a shared data cache and 2 steps (an explicit ``--trainer.max_steps`` becomes 4: an
extension of the 2-step run), every run packs of :data:`PACK` tokens, and the Qwen3-8B parity example runs on
Qwen3-0.6B cut to one layer.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch  # noqa: F401 - imported here, its log handler writes to the real stderr, not a test's capture
import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from xtl.command import main
from xtl.utils import TINY_ASSETS_DIR

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SETUP = ("python3 -m venv", ". .venv/bin/activate", "pip install")
LINKED = ("configs", "callbacks")
# a second rank is started by Lightning re-running the command line: these commands run as a process of their own
OWN_PROCESS = ("tiny_moe_ep.yaml", "--trainer.devices 2")
NO_GPU = "no usable GPU"
PACK = 128  # the packs of a documented run (the tiny recipes' 512 makes fp8 on CPU, an emulated matmul, slow)
# what the tool examples write where their command says (beside the run folders)
OUTPUTS = ("fp8_ckpt", "ckpt_hf", "merged", "merged_linked")


@dataclass
class Block:
    """A marked command block: where it is, how it must end, its commands (continuations joined)."""

    path: Path
    line: int
    gpu: bool
    commands: list[str]

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The ``doctest`` blocks of a document, in order."""
    text = path.read_text()
    found = []
    for match in BLOCK.finditer(text):
        marks = match.group(2).split()
        if not any(m.startswith("doctest") for m in marks):
            continue
        line = text[: match.start()].count("\n") + 1
        joined = match.group(3).replace("\\\n", " ")
        commands = []
        for raw in joined.splitlines():
            for part in shlex.join(shlex.split(raw, comments=True)).split(" '&&' "):  # a && b: two commands
                if part and not part.startswith(SETUP):
                    commands.append(part)
        found.append(Block(path, line, "doctest=gpu" in marks, commands))
    return found


class StandIns:
    """Tiny files for the paths the documents name, and the rewriting of a documented command."""

    def __init__(self, root: Path, cache: Path) -> None:
        self.root, self.cache = root, cache
        hf = self._hf_model(root / "hf_model", hidden=32, dtype=torch.float32)
        bf16 = self._hf_model(root / "bf16_ckpt", hidden=128, dtype=torch.bfloat16)
        from xtl.tools.fp8 import convert_to_fp8

        convert_to_fp8(bf16, root / "fp8_ref")
        extra = root / "run_b"
        extra.mkdir()
        shutil.copy(bf16 / "config.json", extra / "config.json")
        save_file({"mtp.0.proj.weight": torch.zeros(128, 128, dtype=torch.bfloat16)}, str(extra / "model.safetensors"))
        (root / "prompts.txt").write_text("What is 2+3?\n\nRepeat: pencil\n")
        self.paths = {
            "path/to/hf_model": hf,
            "/models/Qwen3-0.6B": hf,
            "/data/sft.jsonl": TINY_ASSETS_DIR / "sft_train.jsonl",
            "bf16_ckpt": bf16,
            "engine_ckpt": bf16,
            "ckpt_engine": bf16,
            "run_a": bf16,
            "fp8_ref": root / "fp8_ref",
            "run_b": extra,
            "prompts.txt": root / "prompts.txt",
        }
        self.phrases = {"qwen3-8b --random --max-layers 2": "qwen3-0.6b --random --max-layers 1"}

    def rewrite(self, command: str) -> tuple[dict[str, str], list[str]]:
        """``(environment assignments, xtl arguments)`` of a documented command, with the stand-ins in."""
        for phrase, stand_in in self.phrases.items():
            command = command.replace(phrase, stand_in)
        words = shlex.split(command)
        env = {}
        if words and words[0] == "export":
            words = words[1:]
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = self._path(value)
        words = [self._assignment(w) if "=" in w and not w.startswith("-") else self._path(w) for w in words]
        if not words:
            return env, []
        if words[0] != "xtl":
            raise AssertionError(f"not an xtl command: {command}")
        args = words[1:]
        if args and args[0] in ("fit", "validate", "test", "predict"):
            args += ["--data.cache_dir", str(self.cache)]
            if "--data.pack_max_length" not in args:
                args += ["--data.pack_max_length", str(PACK)]
        if args and args[0] == "fit":
            if "--trainer.max_steps" in args:
                args[args.index("--trainer.max_steps") + 1] = "4"
            else:
                args += ["--trainer.max_steps", "2"]
        return env, args

    def _path(self, word: str) -> str:
        return str(self.paths.get(word, word))

    def _assignment(self, word: str) -> str:
        name, _, value = word.partition("=")
        return f"{name}={self._path(value)}" if re.fullmatch(r"[A-Z_][A-Z0-9_]*", name) else word

    @staticmethod
    def _hf_model(path: Path, hidden: int, dtype: torch.dtype) -> Path:
        config = Qwen3Config(
            vocab_size=1600, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, max_position_embeddings=512,
        )  # fmt: skip
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).to(dtype).save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(TINY_ASSETS_DIR / name, path / name)
        return path


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory, data_cache) -> StandIns:
    return StandIns(tmp_path_factory.mktemp("stand_ins"), data_cache)


class TestDocumentedCommands:
    @pytest.mark.slow
    @pytest.mark.parametrize("doc", [d for d in DOCS if blocks(d)], ids=lambda p: p.name)
    def test_every_marked_block_runs_as_written(self, doc, stand_ins, tmp_path, monkeypatch, capfd):
        for name in LINKED:
            (tmp_path / name).symlink_to(ROOT / name)
        monkeypatch.chdir(tmp_path)
        for block in blocks(doc):
            for command in block.commands:
                env, args = stand_ins.rewrite(command)
                for name, value in env.items():
                    monkeypatch.setenv(name, value)
                if not args:
                    continue
                code, out = _run(args, capfd)
                where = f"{block}: {command}\n{out[-3000:]}"
                assert "Traceback" not in out, where
                if block.gpu and not torch.cuda.is_available():
                    assert code == 2 and NO_GPU in out, where
                else:
                    assert code == 0, where
        written = {p.name for p in tmp_path.iterdir()} - set(LINKED)
        assert written <= {"runs", *OUTPUTS}, f"written outside a run folder: {sorted(written)}"

    def test_every_xtl_block_is_marked(self):
        """A new command block cannot slip past: every bash block that runs ``xtl`` is marked."""
        for doc in DOCS:
            text = doc.read_text()
            for match in BLOCK.finditer(text):
                if match.group(1) == "bash" and "xtl " in match.group(3) and "doctest" not in match.group(2):
                    pytest.fail(f"{doc.name}:{text[: match.start()].count(chr(10)) + 1} is not marked doctest")

    def test_commands_are_split_and_setup_skipped(self, tmp_path):
        doc = tmp_path / "doc.md"
        line = "python3 -m venv .venv && . .venv/bin/activate && xtl fit \\\n  --a 'b c'  # d"
        doc.write_text(f"```bash doctest\n{line}\n```\n```bash doctest=gpu\nxtl fit\n```\n")
        plain, gpu = blocks(doc)
        assert plain.commands == ["xtl fit --a 'b c'"] and not plain.gpu
        assert gpu.commands == ["xtl fit"] and gpu.gpu


class TestDocumentedChoices:
    """Every value a setting's ``Literal`` allows (the one list of them) is named in its section of
    ``docs/configs.md``."""

    @pytest.mark.parametrize(
        ("section", "setting"),
        [
            ("Reinforcement learning", "xtl.rl.loss.LOSS_TYPES"),
            ("Reinforcement learning", "xtl.rl.loss.IMPORTANCE_LEVELS"),
            ("Reinforcement learning", "xtl.rl.loss.REWARD_SCALINGS"),
            ("Reinforcement learning", "xtl.rl.engines.ENGINES"),
            ("Preference optimization", "xtl.train.preference_loss.LOSS_TYPES"),
        ],
    )
    def test_every_choice_is_named(self, section, setting):
        import importlib

        module, name = setting.rsplit(".", 1)
        choices = getattr(importlib.import_module(module), name)
        text = (ROOT / "docs" / "configs.md").read_text()
        body = text[text.index(f"## {section}") :]
        body = body[: body.find("\n## ", 1)]
        spans = " ".join(re.findall(r"`([^`]*)`", body))
        missing = [c for c in choices if not re.search(rf"(?<![\w.]){re.escape(c)}(?!\w)", spans)]
        assert choices and not missing, f"docs/configs.md, {section}: {missing} not named"


def _run(args: list[str], capfd) -> tuple[int, str]:
    """``xtl args`` in this process (or its own, see :data:`OWN_PROCESS`): exit code and everything it printed."""
    capfd.readouterr()
    if any(name in " ".join(args) for name in OWN_PROCESS):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run([sys.executable, "-m", "xtl", *args], env=env, capture_output=True, text=True)
        return proc.returncode, proc.stdout + proc.stderr
    try:
        code = main(args)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capfd.readouterr()
    return code, captured.out + captured.err
