"""Tests for the ``xtl.tools.TOOLS`` registry the ``xtl`` CLI dispatches to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from xtl.tools import TOOLS

REPO = Path(__file__).resolve().parents[2]


class TestRegistry:
    def test_names(self) -> None:
        names = {"memory", "convert", "check-hf-config", "check-parity", "generate", "eval", "build-cache"}
        assert set(TOOLS) == names

    @pytest.mark.parametrize("argv", [["--help"], ["to-fp8", "--help"], ["repack", "--help"], ["patch", "--help"]])
    def test_convert_help(self, argv: list[str], capsys: pytest.CaptureFixture) -> None:
        assert TOOLS["convert"](argv) == 0
        assert "examples:" in capsys.readouterr().out

    @pytest.mark.parametrize("name", ["memory", "check-hf-config"])
    def test_help_and_usage_errors(self, name: str, capsys: pytest.CaptureFixture) -> None:
        assert TOOLS[name](["--help"]) == 0
        assert "exit codes: 0 ok, 1" in capsys.readouterr().out
        assert TOOLS[name](["--no-such-option"]) == 2

    def test_lazy_import_and_module_entry_points(self) -> None:
        code = (
            "import sys, xtl.tools; assert 'torch' not in sys.modules, 'xtl.tools must import lazily'; "
            "import runpy; sys.argv = ['x', '--help']\n"
            "for m in ('memory', 'convert', 'check_hf_config', 'fp8', 'repack', 'patch'):\n"
            "    try:\n"
            "        runpy.run_module('xtl.tools.' + m, run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0, (m, e.code)\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("usage: xtl") == 6
