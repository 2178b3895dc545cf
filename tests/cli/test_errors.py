"""User mistakes end in a short message naming the file (and line) or the key, exit code 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning_utilities.core.imports import RequirementCache

from xtl.command import main

ROOT = Path(__file__).resolve().parents[2]
GOOD = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
BAD_DATA = {
    "truncated": (GOOD + '{"messages": [{"role": "user", "con\n', ":2: malformed JSON"),
    "unknown_role": (
        '{"messages": [{"role": "wizard", "content": "hi"}]}\n',
        ":1: message 0 has unknown role 'wizard'",
    ),
    "empty": ("", ": no usable rows"),
    "not_a_list": ('{"messages": "hello"}\n', ":1: 'messages' must be a non-empty list"),
    "missing": (None, " does not exist"),
}


def _run(args: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(args)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


def _assert_short(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) <= 30, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in:\n{err}"


class TestBadData:
    @pytest.mark.parametrize("case", sorted(BAD_DATA))
    def test_names_the_file_and_line(self, case, tmp_path, data_cache, capsys):
        text, expected = BAD_DATA[case]
        path = tmp_path / f"{case}.jsonl"
        if text is not None:
            path.write_text(text)
        args = ["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--data.sources",
                f"[{{path: {path}, kind: chat}}]", "--data.val_sources", "null", "--trainer.max_steps", "1",
                "--data.cache_dir", str(tmp_path / "cache"), "--trainer.default_root_dir", str(tmp_path / "run"),
                "--trainer.enable_progress_bar", "false"]  # fmt: skip
        code, err = _run(args, capsys)
        _assert_short(code, err, f"{path}{expected}")


class TestPipes:
    def test_output_piped_into_head_ends_quietly(self):
        command = [sys.executable, "-m", "xtl", "memory", "qwen3-8b", "--format", "json"]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # the reader is gone before xtl writes, as with `| head` on a slow start
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


class TestBadConfig:
    def _fit(self, tmp_path: Path, capsys, *extra: str) -> tuple[int, str]:
        return _run(["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), *extra, "--print_config"], capsys)

    def test_typo_in_a_top_level_key(self, tmp_path, capsys):
        config = tmp_path / "typo.yaml"
        config.write_text("trainr:\n  max_steps: 3\n")
        code, err = self._fit(tmp_path, capsys, "--config", str(config))
        _assert_short(code, err, "trainr.max_steps", "did you mean 'trainer.max_steps'?")

    def test_typo_in_a_model_field(self, tmp_path, capsys):
        config = tmp_path / "typo.yaml"
        config.write_text("model:\n  init_args:\n    model:\n      model_type: qwen3\n      hiden_size: 3\n")
        code, err = _run(["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(config),
                          "--trainer.max_steps", "1"], capsys)  # fmt: skip
        _assert_short(
            code, err, "model.init_args.model: unknown field(s) ['hiden_size']", "did you mean 'hidden_size'"
        )
        assert "Namespace(" not in err

    def test_a_string_where_a_float_is_expected(self, tmp_path, capsys):
        code, err = self._fit(tmp_path, capsys, "--model.init_args.optimizer.lr", "fast")
        _assert_short(code, err, '"lr"', "Expected a <class 'float'>. Got value: fast")

    def test_family_settings_the_model_does_not_have_are_refused(self, tmp_path, capsys):
        """Router settings on a dense model would be ignored silently."""
        run = ["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--trainer.default_root_dir", str(tmp_path)]
        code, err = _run([*run, "--model.init_args.routing.z_loss_coef", "0.1"], capsys)
        _assert_short(code, err, "model.init_args.routing: qwen3 has no routed experts", "remove routing")
        code, err = _run([*run, "--model.init_args.freeze", "[vision]"], capsys)
        _assert_short(
            code, err, "model.init_args.freeze: a dense model has no part 'vision'", "its parts are language"
        )

    def test_a_command_line_typo_gets_a_suggestion(self, tmp_path, capsys):
        code, err = self._fit(tmp_path, capsys, "--trainer.max_stpes=5")
        _assert_short(code, err, "unrecognized arguments: --trainer.max_stpes=5", "did you mean '--trainer.max_steps'")

    def test_a_prefix_of_a_key_is_not_taken_for_the_key(self, tmp_path, capsys):
        code, err = self._fit(tmp_path, capsys, "--trainer.max_step=5")
        _assert_short(code, err, "--trainer.max_step=5", "did you mean '--trainer.max_steps'")

    def test_an_unknown_nested_option_is_named_with_its_key_path(self, tmp_path, capsys):
        code, err = self._fit(tmp_path, capsys, "--model.init_args.optimizer.lrr", "1")
        _assert_short(code, err, "'model.init_args.optimizer.lrr'", "did you mean '--model.init_args.optimizer.lr'")

    def test_a_gpu_recipe_on_a_machine_without_a_gpu(self, tmp_path, capsys, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        hf = tmp_path / "hf"
        hf.mkdir()
        monkeypatch.setenv("QWEN3_0_6B_PATH", str(hf))
        monkeypatch.setenv("SFT_DATA", str(tmp_path / "sft.jsonl"))
        config = tmp_path / "model.yaml"  # a from-scratch model: the directory holds no config
        config.write_text("model:\n  init_args:\n    model: {model_type: qwen3, hidden_size: 32}\n")
        code, err = _run(
            ["fit", "--config", str(ROOT / "configs/qwen3_0.6b_sft.yaml"), "--config", str(config)], capsys
        )
        _assert_short(
            code, err, "trainer.accelerator is gpu but this machine has no usable GPU", "--trainer.accelerator cpu"
        )

    def test_a_logger_whose_package_is_missing(self, tmp_path, capsys, monkeypatch):
        """callbacks/wandb.yaml without wandb installed: which package, and how to install it."""
        import lightning.pytorch.loggers.wandb as wandb_logger

        monkeypatch.setattr(wandb_logger, "_WANDB_AVAILABLE", RequirementCache("wandb>=99"))
        code, err = _run(
            ["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(ROOT / "callbacks/wandb.yaml"),
             "--trainer.default_root_dir", str(tmp_path)], capsys)  # fmt: skip
        _assert_short(code, err, "a package this run needs is not installed: wandb", "pip install -e '.[wandb]'")

    def test_xtl_debug_shows_the_traceback(self, tmp_path, capsys, monkeypatch):
        monkeypatch.setenv("XTL_DEBUG", "1")
        config = tmp_path / "typo.yaml"
        config.write_text("model:\n  init_args:\n    model:\n      model_type: qwen3\n      hiden_size: 3\n")
        with pytest.raises(Exception, match="hiden_size"):
            main(["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--config", str(config)])


@pytest.mark.slow
@pytest.mark.distributed
class TestForeignStrategy:
    def test_two_processes_under_lightnings_ddp_are_refused_before_the_first_step(self, tmp_path, data_cache):
        """``--trainer.devices 2`` with the default strategy (Lightning's DDP) gave every rank the whole data layout
        of one process (rank 1 of 1: a ValueError traceback from the sampler); it is refused in one line."""
        command = [sys.executable, "-m", "xtl", "fit", "--config", str(ROOT / "configs/tiny_sft.yaml")]
        command += ["--trainer.devices", "2", "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false"]
        command += ["--trainer.default_root_dir", str(tmp_path / "run"), "--data.cache_dir", str(data_cache)]
        command += ["--model.init_args.model.num_hidden_layers", "1"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        _assert_short(proc.returncode, proc.stderr, "trainer.strategy: DDPStrategy runs 2 processes")
        assert not (tmp_path / "run" / "checkpoints").exists()
