"""Tests for ``xtl convert patch``: ``out = base ∪ (extra \\ base)``, base wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from xtl.model.hf import is_standard_layout
from xtl.tools import convert
from xtl.tools.patch import diff_checkpoints, patch_checkpoint


@pytest.fixture
def pair(make_ckpt) -> tuple[Path, Path]:
    base = make_ckpt(
        "base",
        {
            "model-00001-of-00002.safetensors": {"a": torch.full((4,), 1.0), "b": torch.full((4,), 1.0)},
            "model-00002-of-00002.safetensors": {"c": torch.full((4,), 1.0)},
        },
        config={"model_type": "base"},
    )
    (base / "tokenizer.json").write_text('{"base": true}')
    (base / "extra_dir").mkdir()
    (base / "extra_dir" / "x.py").write_text("# base code")
    extra = make_ckpt(
        "extra",
        {
            "s1.safetensors": {"b": torch.full((4,), 2.0), "mtp.w": torch.full((64, 64), 2.0)},
            "s2.safetensors": {"head.new": torch.full((64, 64), 2.0), "c": torch.full((4,), 2.0)},
        },
        config={"model_type": "extra"},
    )
    (extra / "tokenizer.json").write_text('{"extra": true}')
    return base, extra


def _read(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for name, shard in index["weight_map"].items():
        with safe_open(directory / shard, framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


class TestPatch:
    def test_diff_summary(self, pair: tuple[Path, Path]) -> None:
        plan = diff_checkpoints(*pair)
        assert (plan.in_base, plan.in_extra) == (3, 4)
        assert plan.added == ["head.new", "mtp.w"] and plan.dropped == ["b", "c"]

    def test_union_base_wins_and_layout(self, pair: tuple[Path, Path], tmp_path: Path) -> None:
        base, extra = pair
        weight_map = patch_checkpoint(base, extra, tmp_path / "out", max_shard_size="20000B")
        out = _read(tmp_path / "out")
        assert set(out) == {"a", "b", "c", "mtp.w", "head.new"}
        assert all(torch.equal(out[k], torch.full((4,), 1.0)) for k in "abc"), "base wins on overlap"
        assert torch.equal(out["mtp.w"], torch.full((64, 64), 2.0)) and torch.equal(out["head.new"], out["mtp.w"])
        shards = sorted(set(weight_map.values()))
        assert shards == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)] and is_standard_layout(shards)
        assert weight_map["a"] == weight_map["b"] == "model-00001-of-00004.safetensors"  # base shards re-emitted
        assert weight_map["c"] == "model-00002-of-00004.safetensors"
        assert (base / "model-00001-of-00002.safetensors").read_bytes() == (
            tmp_path / "out" / "model-00001-of-00004.safetensors"
        ).read_bytes()
        assert json.loads((tmp_path / "out" / "tokenizer.json").read_text()) == {"base": True}
        assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"model_type": "base"}
        assert (tmp_path / "out" / "extra_dir" / "x.py").read_text() == "# base code"
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())

    def test_hardlink_shares_inodes(self, pair: tuple[Path, Path], tmp_path: Path) -> None:
        base, extra = pair
        patch_checkpoint(base, extra, tmp_path / "out", hardlink=True)
        src = base / "model-00002-of-00002.safetensors"
        dst = tmp_path / "out" / "model-00002-of-00003.safetensors"
        assert src.stat().st_ino == dst.stat().st_ino

    def test_dry_run_writes_nothing(
        self, pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
    ) -> None:
        base, extra = pair
        argv = ["patch", "--base", str(base), "--extra", str(extra), "--out", str(tmp_path / "out"), "--dry-run"]
        assert convert.main(argv) == 0
        text = capsys.readouterr().out
        assert "tensors in base:  3" in text and "tensors in extra: 4" in text
        assert "added from extra (extra-only): 2" in text and "dropped from extra (overlap, base wins): 2" in text
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))

    def test_cli_writes_and_reports_input_errors(self, pair: tuple[Path, Path], tmp_path: Path) -> None:
        base, extra = pair
        assert convert.main(["patch", "--base", str(base), "--extra", str(extra), "--out", str(tmp_path / "o")]) == 0
        assert set(_read(tmp_path / "o")) == {"a", "b", "c", "mtp.w", "head.new"}
        (extra / "s2.safetensors").unlink()
        assert convert.main(["patch", "--base", str(base), "--extra", str(extra), "--out", str(tmp_path / "p")]) == 2
        assert not (tmp_path / "p").exists()
        assert convert.main(["patch", "--base", str(base)]) == 2
        assert convert.main(["patch", "--help"]) == 0
