"""Process-wide helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from xtl.errors import ConfigError
from xtl.ops import hf_impl, hf_impl_enabled
from xtl.train import resolve_model_config
from xtl.utils import TINY_ASSETS_DIR, atomic_directory, resolve_path, resolve_pretrained


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


class TestResolvePretrained:
    """Hub ids resolve through huggingface_hub's cache, here pre-populated by hand and with the hub offline."""

    @pytest.fixture
    def offline_cache(self, tmp_path, monkeypatch):
        from huggingface_hub import constants
        from transformers import Qwen3Config

        cache = tmp_path / "hub"
        repo = cache / "models--acme--tiny-qwen3"
        commit = "0123456789abcdef0123456789abcdef01234567"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
        snapshot = repo / "snapshots" / commit
        Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16).save_pretrained(snapshot)  # fmt: skip
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        return snapshot

    def test_a_cached_hub_id_resolves_to_its_snapshot(self, offline_cache):
        assert Path(resolve_pretrained("acme/tiny-qwen3", "model")) == offline_cache
        config, hf_dir = resolve_model_config("acme/tiny-qwen3")
        assert config.model_type == "qwen3" and config.hidden_size == 32 and hf_dir == offline_cache

    def test_an_uncached_hub_id_offline_is_a_clear_error(self, offline_cache):
        with pytest.raises(ConfigError, match=r"data.tokenizer: 'acme/missing' is not in the Hugging Face cache .* "
                           r"and the hub is offline \(HF_HUB_OFFLINE=1\)"):  # fmt: skip
            resolve_pretrained("acme/missing", "data.tokenizer")

    def test_local_paths_and_aliases_are_left_alone(self, tmp_path):
        assert resolve_pretrained(str(tmp_path), "model") == str(tmp_path)
        assert resolve_pretrained("qwen3-8b", "model") == "qwen3-8b"
