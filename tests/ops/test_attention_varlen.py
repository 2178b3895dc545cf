"""The ``varlen`` path (``torch.nn.attention.varlen.varlen_attn``): its Python logic on CPU, the kernel on GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import xtl.ops.attention as attention
from xtl.ops.attention import (
    AttentionMaskSpec,
    eager_attention,
    flatten_heads,
    get_attn_impl_fn,
    sdpa_attention,
    unflatten_heads,
    varlen_attention,
    varlen_available,
    varlen_cu_seqlens,
    varlen_window,
)


def _qkv(batch=1, seq=20, heads=4, kv_heads=2, dim=16, v_dim=None, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    return (
        torch.randn(batch, heads, seq, dim, dtype=dtype, device=device),
        torch.randn(batch, kv_heads, seq, dim, dtype=dtype, device=device),
        torch.randn(batch, kv_heads, seq, v_dim or dim, dtype=dtype, device=device),
    )


def _packed(bounds, **kwargs):
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    return AttentionMaskSpec(cu_seq_lens=torch.tensor(bounds, dtype=torch.int32), max_seq_len=max(lengths), **kwargs)


def _reference_varlen_attn(calls):
    """A CPU stand-in for ``varlen_attn`` with FlashAttention's semantics, recording the arguments it gets."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa):
        calls.append(dict(cu=cu_seq_q, max_q=max_q, window_size=window_size, enable_gqa=enable_gqa))
        assert cu_seq_q is cu_seq_k and cu_seq_q.dtype == torch.int32 and max_q == max_k
        assert query.shape[-1] == key.shape[-1] == value.shape[-1]  # the kernel needs one head dim
        assert enable_gqa == (query.shape[1] != key.shape[1])
        bounds = cu_seq_q.tolist()
        assert max_q >= max(e - s for s, e in zip(bounds[:-1], bounds[1:]))
        left, right = window_size
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        out = torch.empty_like(query)
        for s, e in zip(bounds[:-1], bounds[1:]):
            pos = torch.arange(e - s)
            behind = pos[:, None] - pos[None, :]  # query minus key
            allowed = (behind >= -right) if right >= 0 else torch.ones_like(behind, dtype=torch.bool)
            if left >= 0:
                allowed = allowed & (behind <= left)
            scores = torch.einsum("qhd,khd->hqk", query[s:e], key[s:e]) * scale
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[s:e] = torch.einsum("hqk,khd->qhd", probs, value[s:e])
        return out

    return varlen_attn


class TestVarlenHelpers:
    def test_window(self):
        assert varlen_window(None) == (-1, 0)  # varlen_attn's causal, detected by == (-1, 0): a tuple
        assert varlen_window(4) == (3, 0)  # the query and the 3 keys before it: transformers' window of 4

    def test_flatten_round_trip(self):
        q = torch.randn(2, 4, 5, 8)
        flat = flatten_heads(q)
        assert flat.shape == (10, 4, 8)
        assert torch.equal(flat[7], q[1, :, 2])  # row 1, token 2
        assert torch.equal(unflatten_heads(flat, 2), q.transpose(1, 2))

    def test_cu_seqlens(self):
        cpu = torch.device("cpu")
        cu, max_len = varlen_cu_seqlens(AttentionMaskSpec(), 3, 5, cpu)
        assert cu.tolist() == [0, 5, 10, 15] and cu.dtype == torch.int32 and max_len == 5
        cu, max_len = varlen_cu_seqlens(_packed([0, 3, 10, 12]), 1, 12, cpu)
        assert cu.tolist() == [0, 3, 10, 12] and cu.dtype == torch.int32 and max_len == 7
        no_max = AttentionMaskSpec(cu_seq_lens=torch.tensor([0, 3, 10, 12]))
        assert varlen_cu_seqlens(no_max, 1, 12, cpu)[1] == 7  # from doc_bounds, not from the tensor
        no_max.doc_bounds = None
        assert varlen_cu_seqlens(no_max, 1, 12, cpu)[1] == 12  # an upper bound, no device read

    def test_selector(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        for flash, varlen, expected in [
            (True, True, attention.flash_attention),
            (False, True, varlen_attention),
            (False, False, sdpa_attention),
        ]:
            monkeypatch.setattr(attention, "flash_attn_available", lambda flash=flash: flash)
            monkeypatch.setattr(attention, "varlen_available", lambda varlen=varlen: varlen)
            assert get_attn_impl_fn("auto") is expected
        monkeypatch.setattr(attention, "varlen_available", lambda: True)
        assert get_attn_impl_fn("varlen") is varlen_attention
        monkeypatch.setenv("XTL_HF_IMPL", "1")
        assert get_attn_impl_fn("varlen") is eager_attention

    def test_varlen_needs_cuda(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        monkeypatch.setattr(attention, "varlen_available", lambda: False)
        with pytest.raises(ValueError, match="attn_impl='varlen' needs CUDA"):
            get_attn_impl_fn("varlen")

    def test_cpu_falls_back_to_sdpa(self):
        q, k, v = _qkv()
        mask = _packed([0, 6, 15, 20])
        assert not attention.varlen_supported(q, k, v, mask)
        assert torch.equal(varlen_attention(q, k, v, mask, 0.25), sdpa_attention(q, k, v, mask, 0.25))

    @pytest.mark.parametrize(
        ("case", "batch", "spec", "kv_heads", "v_dim"),
        [
            ("causal_batch", 2, AttentionMaskSpec(), 2, None),
            ("packed_gqa", 1, _packed([0, 6, 15, 20]), 2, None),
            ("packed_mha", 1, _packed([0, 6, 15, 20]), 4, None),
            ("packed_sliding", 1, _packed([0, 11, 20], sliding_window=3), 2, None),
            ("sliding_batch", 2, AttentionMaskSpec(sliding_window=4), 1, None),
            ("mla_value_dim", 1, _packed([0, 6, 15, 20]), 4, 8),
        ],
    )
    def test_kernel_arguments_against_eager(self, monkeypatch, case, batch, spec, kv_heads, v_dim):
        calls = []
        import torch.nn.attention.varlen as torch_varlen

        monkeypatch.setattr(torch_varlen, "varlen_attn", _reference_varlen_attn(calls))
        monkeypatch.setattr(attention, "varlen_supported", lambda *args, **kwargs: True)
        q, k, v = _qkv(batch=batch, kv_heads=kv_heads, v_dim=v_dim)
        out = varlen_attention(q, k, v, spec, 0.25)
        assert len(calls) == 1 and calls[0]["window_size"] == varlen_window(spec.sliding_window)
        assert out.shape == (batch, 20, 4, v_dim or 16)
        # fp32 on CPU, einsum vs matmul order: 1e-5.
        torch.testing.assert_close(out, eager_attention(q, k, v, spec, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not varlen_available(), reason="torch varlen_attn needs a CUDA GPU")
class TestVarlenKernel:
    # bf16 FlashAttention vs the eager reference (fp32 softmax) on the same bf16 inputs: 2e-2, bf16 rounding of
    # O(1) outputs and of gradients summed over up to 20 keys.
    @pytest.mark.parametrize(
        ("batch", "spec", "kv_heads", "v_dim"),
        [
            (2, AttentionMaskSpec(), 2, None),
            (1, _packed([0, 6, 15, 20]), 2, None),
            (1, _packed([0, 6, 15, 20]), 4, None),
            (1, _packed([0, 11, 20], sliding_window=3), 2, None),
            (2, AttentionMaskSpec(sliding_window=4), 1, None),
            (1, _packed([0, 6, 15, 20]), 4, 8),
        ],
        ids=["causal_batch", "packed_gqa", "packed_mha", "packed_sliding", "sliding_batch", "mla_value_dim"],
    )
    def test_matches_eager_forward_and_backward(self, batch, spec, kv_heads, v_dim):
        q, k, v = _qkv(batch=batch, kv_heads=kv_heads, v_dim=v_dim, dtype=torch.bfloat16, device="cuda")
        if spec.cu_seq_lens is not None:
            spec = replace(spec, cu_seq_lens=spec.cu_seq_lens.cuda())
        assert attention.varlen_supported(q, k, v, spec)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(q, k, v, spec, 0.25)
        ref = eager_attention(*ref_inputs, spec, 0.25)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(grad)
        for ours, theirs in zip((q, k, v), ref_inputs):
            torch.testing.assert_close(ours.grad, theirs.grad, atol=2e-2, rtol=2e-2)

    def test_packed_matches_per_document_sdpa(self):
        q, k, v = _qkv(seq=37, dtype=torch.bfloat16, device="cuda")
        bounds = [0, 5, 12, 17, 20, 27, 32, 33, 37]
        spec = _packed(bounds)
        spec = replace(spec, cu_seq_lens=spec.cu_seq_lens.cuda())
        torch.testing.assert_close(
            varlen_attention(q, k, v, spec, 0.25), sdpa_attention(q, k, v, spec, 0.25), atol=2e-2, rtol=2e-2
        )
