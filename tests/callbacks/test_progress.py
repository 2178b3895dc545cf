"""``StepProgressBar`` and the other bars a run draws: each is drawn as itself, once, and ends its line."""

from __future__ import annotations

import subprocess
import sys

from tests.cli.test_cli import ROOT, _tiny_args


def _run_combined(args: list[str], cwd) -> tuple[int, str]:
    """``xtl`` with stdout and stderr in one stream, as a terminal shows them (carriage returns as line ends)."""
    proc = subprocess.run(
        [sys.executable, "-m", "xtl", *args], cwd=cwd, capture_output=False, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300,
    )  # fmt: skip
    return proc.returncode, proc.stdout.replace("\r", "\n")


class TestStepProgressBar:
    def test_one_train_bar_drawn_first_and_closed_before_the_stop_message(self, tmp_path, data_cache):
        args = ["fit", *_tiny_args(ROOT / "configs/tiny_sft.yaml", data_cache), "--trainer.max_steps", "3"]
        args.remove("--trainer.enable_progress_bar")
        args.remove("false")
        code, out = _run_combined(args, tmp_path)
        assert code == 0, out
        lines = [line for line in out.splitlines() if line.strip()]
        bars = [line for line in lines if "/3 [" in line]
        assert bars and all(line.startswith("train:") for line in bars), "no 'Training' bar of Lightning's"
        assert sum("3/3 [" in line for line in bars) == 1, "the final bar is drawn once"
        assert "`Trainer.fit` stopped: `max_steps=3` reached." in lines, "the stop message has its own line"


class TestTokenizingBar:
    def test_a_data_error_is_not_followed_by_the_bar_again(self, tmp_path):
        data = tmp_path / "bad.jsonl"
        data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' * 300 + "{not json\n")
        args = ["fit", "--config", str(ROOT / "configs/tiny_sft.yaml"), "--data.sources", f"[{{path: {data}}}]",
                "--data.val_sources", "null", "--data.cache_dir", str(tmp_path / "cache")]  # fmt: skip
        code, out = _run_combined(args, tmp_path)
        assert code == 2, out
        lines = [line for line in out.splitlines() if line.strip()]
        assert lines[-1].startswith("xtl: error:") and "bad.jsonl:301" in lines[-1], lines[-3:]
