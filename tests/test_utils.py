"""Process-wide helpers."""

from __future__ import annotations

import pytest

from xtl.ops import hf_impl, hf_impl_enabled
from xtl.utils import TINY_ASSETS_DIR, atomic_directory, resolve_path


class TestResolvePath:
    def test_forms(self, monkeypatch, tmp_path):
        monkeypatch.setenv("XTL_TEST_DIR", str(tmp_path))
        assert resolve_path("env:XTL_TEST_DIR") == str(tmp_path)
        assert resolve_path("tiny:sft_train.jsonl") == str(TINY_ASSETS_DIR / "sft_train.jsonl")
        assert resolve_path("tiny:") == str(TINY_ASSETS_DIR)
        assert resolve_path("/plain/path") == "/plain/path"
        assert not resolve_path("~/x").startswith("~")

    def test_unset_variable_is_named(self, monkeypatch):
        monkeypatch.delenv("XTL_NOT_SET", raising=False)
        with pytest.raises(ValueError, match="environment variable XTL_NOT_SET is not set"):
            resolve_path("env:XTL_NOT_SET")


class TestAtomicDirectory:
    def test_success_replaces_and_failure_keeps(self, tmp_path):
        target = tmp_path / "out"
        with atomic_directory(target) as tmp:
            (tmp / "a").write_text("1")
        with pytest.raises(RuntimeError), atomic_directory(target) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("crash")
        assert (target / "a").read_text() == "1"
        assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_hf_impl_context_restores(monkeypatch):
    monkeypatch.delenv("XTL_HF_IMPL", raising=False)
    with hf_impl():
        assert hf_impl_enabled()
    assert not hf_impl_enabled()
