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

The documented configs parse: every ```` ```yaml ```` block is a config fragment that ``xtl``'s own parser accepts
(:class:`~xtl.cli.ParseOnlyCLI`, nothing instantiated) on top of a base recipe, :data:`BASE` unless the info string
says ``base=configs/NAME.yaml``; an excerpt of a section says where it sits with ``under=KEY.PATH`` (``under=
model.init_args`` for an ``optimizer:`` excerpt). A YAML block that is not an xtl config opts out with
``not-config: WHY`` in its info string. The user code that examples name (``my_judgers``, ``mypackage``) is a
stand-in module (:data:`USER_CODE`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
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
BASE = "configs/tiny_sft.yaml"  # the recipe a documented config fragment is added to, unless it names its base
NOT_CONFIG = "not-config:"
# the user modules that documented configs name: each class or function a stand-in of the kind the key takes
USER_CODE = {
    "my_judgers.py": "from xtl.rl.judger import SyncJudger\n\n\nclass UnitTests(SyncJudger):\n"
    "    def score(self, payload):\n        return 1.0\n\n\ndef exact_answer(response, ground_truth, **extra):\n"
    "    return 1.0\n",
    "mypackage/__init__.py": "",
    "mypackage/games.py": "class GuessingGame:\n    pass\n",
    "mypackage/tools.py": "def search(query: str) -> str:\n    return query\n",
}


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


@dataclass
class YamlBlock:
    """A ```` ```yaml ```` block: where it is, its text, the marks of its info string."""

    path: Path
    line: int
    text: str
    marks: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name}:{self.line}"

    @property
    def reason(self) -> str | None:
        """Why the block is not an xtl config (``not-config: WHY``), or ``None`` for a config."""
        marks = self.marks.strip()
        return marks.split(NOT_CONFIG, 1)[1].strip() if NOT_CONFIG in marks else None

    def mark(self, name: str, default: str | None = None) -> str | None:
        """The value of ``name=VALUE`` in the info string."""
        found = re.search(rf"(?<!\S){name}=(\S+)", self.marks)
        return found.group(1) if found else default

    def config(self) -> str:
        """The fragment as a whole config: dedented, and nested under its ``under=`` keys."""
        text = textwrap.dedent(self.text)
        for key in reversed((self.mark("under") or "").split(".") if self.mark("under") else []):
            text = f"{key}:\n" + textwrap.indent(text, "  ")
        return text


def yaml_blocks(path: Path) -> list[YamlBlock]:
    """The ``yaml`` blocks of a document, in order."""
    text = path.read_text()
    return [
        YamlBlock(path, text[: m.start()].count("\n") + 1, m.group(3), m.group(2))
        for m in BLOCK.finditer(text)
        if m.group(1) in ("yaml", "yml")
    ]


def parse_error(block: YamlBlock, folder: Path) -> str | None:
    """What xtl's parser says of ``block`` on top of its base recipe (``None``: it parses)."""
    from xtl.cli import ParseOnlyCLI, XTLArgumentParser

    class RaisingParser(XTLArgumentParser):
        def error(self, message: str, ex: Exception | None = None) -> None:
            raise ValueError(str(message).strip())

    class ParseOnly(ParseOnlyCLI):
        def init_parser(self, **kwargs):
            self.parser_class = RaisingParser
            return super().init_parser(**kwargs)

    fragment = folder / f"{block.path.stem}_{block.line}.yaml"
    fragment.write_text(block.config())
    args = ["--config", str(ROOT / block.mark("base", BASE)), "--config", str(fragment)]
    XTLArgumentParser.argv = args
    try:
        ParseOnly(args=args, run=False)
    except ValueError as err:
        return str(err)
    return None


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


@pytest.fixture
def user_code(tmp_path, monkeypatch) -> Iterator[Path]:
    """The stand-in user modules of :data:`USER_CODE`, importable."""
    for name, source in USER_CODE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    _forget_user_code()


class TestDocumentedConfigs:
    @pytest.mark.parametrize("block", [b for d in DOCS for b in yaml_blocks(d)], ids=str)
    def test_every_yaml_block_parses(self, block, user_code):
        if block.reason is not None:
            assert len(block.reason.split()) >= 3, f"{block}: say why it is not an xtl config ({NOT_CONFIG} WHY)"
            return
        error = parse_error(block, user_code)
        assert error is None, f"{block} (base {block.mark('base', BASE)}) is refused by xtl's parser:\n{error}"

    def test_every_config_block_is_a_yaml_block(self):
        """A config in a block of another language (``text``, none) cannot slip past the parse."""
        import yaml

        for doc in DOCS:
            text = doc.read_text()
            for match in BLOCK.finditer(text):
                if match.group(1) in ("yaml", "yml"):
                    continue
                try:
                    loaded = yaml.safe_load(match.group(3))
                except yaml.YAMLError:
                    continue
                if isinstance(loaded, dict) and {"trainer", "model", "data"} & set(loaded):
                    pytest.fail(f"{doc.name}:{text[: match.start()].count(chr(10)) + 1} is a config: mark it yaml")

    def test_a_refused_fragment_fails(self, user_code):
        """The check can fail: the data module takes its arguments directly, so ``data: init_args:`` is refused."""
        doc = user_code / "doc.md"
        doc.write_text("```yaml\ndata:\n  init_args:\n    seed: 1\n```\n```yaml\ndata:\n  seed: 1\n```\n")
        wrong, right = yaml_blocks(doc)
        assert "init_args" in parse_error(wrong, user_code)
        assert parse_error(right, user_code) is None

    def test_marks(self, tmp_path):
        doc = tmp_path / "doc.md"
        doc.write_text(
            "```yaml base=configs/tiny_dpo.yaml under=model.init_args\n    lr: 1\n```\n"
            "```yaml not-config: an lm-eval task file\ntask: x\n```\n"
        )
        nested, other = yaml_blocks(doc)
        assert nested.mark("base") == "configs/tiny_dpo.yaml" and nested.reason is None
        assert nested.config() == "model:\n  init_args:\n    lr: 1\n"
        assert other.reason == "an lm-eval task file"


class TestDocumentedJudgerFunction:
    def test_the_example_scores_through_function_judger(self, tmp_path, monkeypatch):
        """The judger function of docs/configs.md has the signature FunctionJudger calls, under the name its YAML
        gives."""
        from xtl.rl.judger import FunctionJudger, RolloutState

        text = (ROOT / "docs" / "configs.md").read_text()
        source = next(m.group(3) for m in BLOCK.finditer(text) if m.group(3).startswith("# my_judgers.py"))
        fn = re.search(r'fn: "([\w.]+:\w+)"', text[text.index(source) :]).group(1)
        (tmp_path / f"{fn.split(':')[0]}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        _forget_user_code()  # the stand-in module of the same name, imported by a parse
        try:
            judger = FunctionJudger(fn)
        finally:
            _forget_user_code()
        states = [RolloutState(" 5", "5", extra={"level": 1}), RolloutState("6", "5"), RolloutState("5", None)]
        judged = judger.judge_sync(states)
        assert [s.reward["score"] for s in judged] == [1.0, 0.0, 0.0] and all(s.status == "completed" for s in judged)


def _forget_user_code() -> None:
    """Drop the user modules of the documents from ``sys.modules`` (each test imports its own)."""
    roots = {Path(name).parts[0].removesuffix(".py") for name in USER_CODE}
    for name in [m for m in sys.modules if m.split(".")[0] in roots]:
        del sys.modules[name]


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
