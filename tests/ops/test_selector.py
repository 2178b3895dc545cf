"""The HF-parity switch: parsing of ``XTL_HF_IMPL`` and the :func:`hf_impl` context manager."""

from __future__ import annotations

import os

import pytest

from xtl.ops import hf_impl, hf_impl_enabled


class TestHFImplSwitch:
    @pytest.mark.parametrize(
        ("value", "enabled"), [("1", True), (" True ", True), ("on", True), ("0", False), ("", False)]
    )
    def test_env_values(self, monkeypatch, value, enabled):
        monkeypatch.setenv("XTL_HF_IMPL", value)
        assert hf_impl_enabled() is enabled

    def test_context_turns_off_and_restores_a_previous_value(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "yes")
        with hf_impl(False):
            assert not hf_impl_enabled()
            with hf_impl():
                assert hf_impl_enabled()
            assert not hf_impl_enabled()
        assert os.environ["XTL_HF_IMPL"] == "yes"

    def test_context_restores_after_an_exception(self, monkeypatch):
        monkeypatch.delenv("XTL_HF_IMPL", raising=False)
        with pytest.raises(RuntimeError), hf_impl():
            raise RuntimeError("boom")
        assert "XTL_HF_IMPL" not in os.environ
