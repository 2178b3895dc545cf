"""A mistyped key or class gets one line naming it by its full key path, with the closest valid one."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch  # noqa: F401 - imported here, its log handler writes to the real stderr, not a test's capture
import pytest

from xtl.command import main

ROOT = Path(__file__).resolve().parents[2]
GRPO = str(ROOT / "configs/tiny_grpo.yaml")
HELP = "(`xtl fit --help` lists the keys"


def _error(capsys, *args: str) -> str:
    """The error ``xtl fit --config configs/tiny_grpo.yaml ARGS --print_config`` prints (it must exit 2)."""
    try:
        code = main(["fit", "--config", GRPO, *args, "--print_config"])
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "fragment.yaml"
    path.write_text(text)
    return str(path)


class TestNestedOptionTypos:
    @pytest.mark.parametrize(
        ("typed", "meant"),
        [
            ("model.init_args.optimzer.lr", "model.init_args.optimizer.lr"),  # a subclass-typed key: its keys kept
            ("model.init_args.schedul.warmup_steps", "model.init_args.schedule.warmup_steps"),
            ("model.init_args.optimizer.lrr", "model.init_args.optimizer.lr"),
            ("trainer.max_step", "trainer.max_steps"),
        ],
    )
    def test_the_suggestion_keeps_the_key_path(self, typed, meant, capsys):
        err = _error(capsys, f"--{typed}", "1")
        assert typed in err.splitlines()[0], err
        assert f"(did you mean '--{meant}'?)" in err, err
        assert ".help" not in err, err

    def test_no_suggestion_for_a_key_like_none(self, capsys):
        err = _error(capsys, "--model.init_args.zzzzzz.lr", "1")
        assert "model.init_args.zzzzzz.lr" in err and "did you mean" not in err, err


class TestClassPathTypos:
    """A class_path naming no class: one line with the key and the closest class, not jsonargparse's union dump."""

    @pytest.mark.parametrize(
        ("typed", "meant"),
        [
            ("xtl.rl.judger.ExactMatchJuger", "xtl.rl.judger.ExactMatchJudger"),
            ("xtl.rl.ExactMatchJuger", "xtl.rl.ExactMatchJudger"),
            ("ExactMatchJuger", "xtl.rl.ExactMatchJudger"),
            ("xtl.rl.RewardModelJuger", "xtl.rl.RewardModelJudger"),
        ],
    )
    def test_a_judger_on_the_command_line(self, typed, meant, capsys):
        err = _error(capsys, "--model.init_args.judger", typed)
        first, *rest = err.strip().splitlines()
        assert first == (
            f"xtl: error: model.init_args.judger: no class {typed!r} (did you mean {meant!r}?); "
            "a class_path names a subclass of BaseJudger"
        ), err
        assert len(rest) == 1 and HELP in rest[0], err

    def test_a_judger_branch_in_yaml(self, tmp_path, capsys):
        fragment = _yaml(
            tmp_path,
            "model:\n  init_args:\n    judger:\n      class_path: xtl.rl.ComposedJudger\n"
            "      init_args: {branches: {'*': [{class_path: xtl.rl.MathJuger}]}}\n",
        )
        err = _error(capsys, "--config", fragment)
        assert err.startswith(
            "xtl: error: model.init_args.judger.init_args.branches.*[0]: no class 'xtl.rl.MathJuger' "
            "(did you mean 'xtl.rl.MathJudger'?)"
        ), err
        assert len(err.strip().splitlines()) == 2, err

    def test_any_subclass_typed_argument(self, tmp_path, capsys):
        fragment = _yaml(tmp_path, "trainer:\n  callbacks:\n    - class_path: xtl.callbacks.TrainingCheckpont\n")
        err = _error(capsys, "--config", fragment)
        assert err.startswith(
            "xtl: error: trainer.callbacks[0]: no class 'xtl.callbacks.TrainingCheckpont' "
            "(did you mean 'xtl.callbacks.TrainingCheckpoint'?); a class_path names a subclass of Callback"
        ), err
        fragment = _yaml(tmp_path, "model:\n  init_args:\n    optimizer:\n      class_path: xtl.train.MuonConfg\n")
        err = _error(capsys, "--config", fragment)
        assert (
            "model.init_args.optimizer: no class 'xtl.train.MuonConfg' (did you mean 'xtl.train.MuonConfig'?)" in err
        )

    def test_nothing_close(self, capsys):
        err = _error(capsys, "--model.init_args.judger", "xtl.rl.Qqqqqq")
        assert err.startswith("xtl: error: model.init_args.judger: no class 'xtl.rl.Qqqqqq'; a class_path"), err
