"""Attention implementations agree with each other and with an explicit reference."""

from __future__ import annotations

import pytest
import torch

from xtl.ops.attention import AttentionMaskSpec, eager_attention, get_attn_impl_fn, sdpa_attention
from xtl.ops.rms_norm import get_rms_norm_fn, rms_norm_fused, rms_norm_hf


def _qkv(batch=1, seq=20, heads=4, kv_heads=2, dim=16, dtype=torch.float32):
    torch.manual_seed(0)
    return (
        torch.randn(batch, heads, seq, dim, dtype=dtype),
        torch.randn(batch, kv_heads, seq, dim, dtype=dtype),
        torch.randn(batch, kv_heads, seq, dim, dtype=dtype),
    )


def _reference(q, k, v, allowed, scale):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


SPECS = {
    "causal": AttentionMaskSpec(),
    "packed": AttentionMaskSpec(cu_seq_lens=torch.tensor([0, 6, 15, 20], dtype=torch.int32), max_seq_len=9),
    "sliding": AttentionMaskSpec(sliding_window=4),
    "packed_sliding": AttentionMaskSpec(
        cu_seq_lens=torch.tensor([0, 11, 20], dtype=torch.int32), max_seq_len=11, sliding_window=3
    ),
}


class TestAttentionImpls:
    # fp32: different reduction orders; 1e-5 is ~100 ulp at these magnitudes.
    @pytest.mark.parametrize("spec", sorted(SPECS))
    @pytest.mark.parametrize("impl", [eager_attention, sdpa_attention])
    def test_matches_reference(self, impl, spec):
        q, k, v = _qkv()
        mask = SPECS[spec]
        expected = _reference(q, k, v, mask.boolean_mask(1, 20, q.device), 0.25)
        torch.testing.assert_close(impl(q, k, v, mask, 0.25), expected, atol=1e-5, rtol=1e-5)

    def test_padding_mask(self):
        q, k, v = _qkv(batch=2)
        mask = AttentionMaskSpec(padding_mask=torch.tensor([[1] * 20, [1] * 15 + [0] * 5]))
        expected = _reference(q, k, v, mask.boolean_mask(2, 20, q.device), 0.25)
        for impl in (eager_attention, sdpa_attention):
            torch.testing.assert_close(impl(q, k, v, mask, 0.25)[1, :15], expected[1, :15], atol=1e-5, rtol=1e-5)

    def test_selector(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        assert get_attn_impl_fn("sdpa") is sdpa_attention
        assert get_attn_impl_fn("auto") is sdpa_attention  # no CUDA here
        monkeypatch.setenv("XTL_HF_IMPL", "1")
        assert get_attn_impl_fn("sdpa") is eager_attention
        with pytest.raises(ValueError, match="unknown attention implementation"):
            get_attn_impl_fn("magic")

    def test_flash_needs_cuda(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        if torch.cuda.is_available():
            pytest.skip("CUDA present: the error path is for CPU-only machines")
        with pytest.raises(ValueError, match="needs CUDA and the flash-attn package"):
            get_attn_impl_fn("flash")


class TestRMSNorm:
    def test_fused_close_to_hf_order(self):
        x, w = torch.randn(4, 64), torch.randn(64)
        torch.testing.assert_close(rms_norm_fused(x, w, 1e-6), rms_norm_hf(x, w, 1e-6), atol=1e-6, rtol=1e-6)

    def test_selector_follows_env(self, monkeypatch):
        cuda = torch.device("cuda")
        monkeypatch.setenv("XTL_HF_IMPL", "1")
        assert get_rms_norm_fn(cuda) is rms_norm_hf
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        assert get_rms_norm_fn(cuda) is rms_norm_fused
        assert get_rms_norm_fn(torch.device("cpu")) is rms_norm_hf


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn varlen needs a CUDA GPU")
class TestFlashAttention:
    def test_matches_sdpa_on_packed_bf16(self):
        pytest.importorskip("flash_attn")
        from xtl.ops.attention import flash_attention

        q, k, v = (t.cuda().bfloat16() for t in _qkv(seq=20))
        mask = SPECS["packed"]
        torch.testing.assert_close(
            flash_attention(q, k, v, mask, 0.25), sdpa_attention(q, k, v, mask, 0.25), atol=2e-2, rtol=2e-2
        )
