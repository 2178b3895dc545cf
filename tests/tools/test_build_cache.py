"""``xtl build-cache``: usage errors, shards built as separate jobs, assembly, and a fit that finds the cache warm."""

from __future__ import annotations

from pathlib import Path

import pytest

import xtl.data.cache as cache_mod
from xtl.command import main as xtl
from xtl.tools.build_cache import main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny_sft.yaml")
SMALL_MODEL = ["--model.init_args.model.hidden_size", "32", "--model.init_args.model.num_hidden_layers", "1"]


def _args(cache: Path, *extra: str) -> list[str]:
    return ["--config", CONFIG, "--data.cache_dir", str(cache), "--data.progress", "false", *SMALL_MODEL, *extra]


def _forbidden(*args, **kwargs):
    raise AssertionError("tokenized although xtl build-cache had built the entry")


class TestUsage:
    def test_help(self, capsys: pytest.CaptureFixture) -> None:
        assert main(["--help"]) == 0
        out = capsys.readouterr().out
        assert "examples:" in out and "--shard I/N" in out and "exit codes: 0 ok" in out

    @pytest.mark.parametrize(
        "shard,message",
        [("4/4", "shards of 4 are numbered 0..3"), ("a/b", "'a/b' is not I/N"), ("0/0", "N >= 1"), ("1", "not I/N")],
    )
    def test_bad_shard(self, shard: str, message: str, capsys: pytest.CaptureFixture) -> None:
        assert main(["--config", CONFIG, "--shard", shard]) == 2
        assert message in capsys.readouterr().err

    def test_shard_and_assemble_exclude_each_other(self, capsys: pytest.CaptureFixture) -> None:
        assert main(["--config", CONFIG, "--shard", "0/2", "--assemble"]) == 2
        assert "not allowed with" in capsys.readouterr().err

    def test_bad_config_key(self, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
        assert main(_args(tmp_path, "--data.no_such_key", "1")) == 2
        assert "no_such_key" in capsys.readouterr().err


class TestShardsAsJobs:
    def test_assemble_names_the_missing_part(self, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
        assert main(_args(tmp_path, "--shard", "1/2")) == 0
        assert "wait for other shards" in capsys.readouterr().out
        assert main(_args(tmp_path, "--assemble")) == 2
        err = capsys.readouterr().err
        assert "part(s) 0/2 missing" in err and "--shard I/N" in err

    def test_shards_then_fit_finds_the_cache_warm(
        self, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        cache = tmp_path / "cache"
        assert main(_args(cache, "--shard", "1/2")) == 0
        assert main(_args(cache, "--shard", "0/2")) == 0  # the last shard to finish assembles
        out = capsys.readouterr().out
        entries = sorted(p.name for p in cache.iterdir() if p.is_dir() and p.name.startswith("sft_"))
        assert len(entries) == 2 and all(name in out for name in entries)  # training and validation sets
        assert not list(cache.glob("*.parts"))
        monkeypatch.setattr(cache_mod, "_tokenize_into", _forbidden)
        assert main(_args(cache, "--assemble")) == 0  # complete already: nothing to do
        fit = ["fit", *_args(cache), "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path / "run")]
        fit += ["--trainer.enable_progress_bar", "false", "--data.pack_max_length", "128"]
        assert xtl(fit) == 0
        assert sorted(p.name for p in cache.iterdir() if p.is_dir() and p.name.startswith("sft_")) == entries
