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


def _per_document_sdpa(q, k, v, bounds, scale):
    """The previous packed path: one SDPA call per document (the reference the grouped path must equal); short
    16-bit documents in fp32 on CPU, as the packed path does."""
    dtype = q.dtype
    if dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous().to(dtype)


def _packed(lengths, **kwargs):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return AttentionMaskSpec(cu_seq_lens=torch.tensor(bounds, dtype=torch.int32), max_seq_len=max(lengths), **kwargs)


LENGTHS = [5, 7, 5, 3, 7, 5, 1, 4]  # 37 tokens, 5 distinct lengths: 5 thrice, 7 twice, 3, 1, 4 once


class _SdpaSpy:
    """Wraps ``scaled_dot_product_attention`` to record the shapes of its queries and masks."""

    def __init__(self, monkeypatch):
        self.calls = []
        self._sdpa = torch.nn.functional.scaled_dot_product_attention
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", self)

    def __call__(self, q, k, v, attn_mask=None, **kwargs):
        self.calls.append((tuple(q.shape), None if attn_mask is None else tuple(attn_mask.shape)))
        return self._sdpa(q, k, v, attn_mask=attn_mask, **kwargs)


class TestPackedSdpa:
    # Documents padded to their length bucket and stacked along the batch: causality hides the padded keys, so the
    # result equals one call per document up to the kernel's summation order (fp32: 1e-6 on O(1) values; bf16
    # inputs are attended in fp32 on CPU and rounded once).
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
    def test_bucketed_equals_per_document(self, dtype, kv_heads):
        q, k, v = (t.requires_grad_() for t in _qkv(seq=sum(LENGTHS), kv_heads=kv_heads, dtype=dtype))
        mask = _packed(LENGTHS)
        out = sdpa_attention(q, k, v, mask, 0.25)
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref = _per_document_sdpa(*inputs, mask.doc_bounds, 0.25)
        tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
        torch.testing.assert_close(out, ref, **tol)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(grad)
        for ours, theirs in zip((q, k, v), inputs):
            torch.testing.assert_close(ours.grad, theirs.grad, **tol)

    def test_exact_length_groups_equal_per_document_bitwise(self):
        from xtl.ops.attention import attend_by_document_length

        q, k, v = (t.requires_grad_() for t in _qkv(seq=sum(LENGTHS)))
        bounds = _packed(LENGTHS).doc_bounds

        def attend(q, k, v):
            gqa = q.shape[1] != k.shape[1]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=gqa)
            return out.transpose(1, 2)

        out = attend_by_document_length(q, k, v, bounds, attend, bucket=1)  # equal lengths stacked, no padding
        assert torch.equal(out, _per_document_sdpa(q, k, v, bounds, 0.25))

    def test_one_call_per_length_bucket(self, monkeypatch):
        spy = _SdpaSpy(monkeypatch)
        lengths = [5, 20, 17, 33, 3]
        q, k, v = _qkv(seq=sum(lengths))
        sdpa_attention(q, k, v, _packed(lengths), 0.25)
        # (documents stacked, padded length) of each call: buckets of 16 tokens
        assert sorted((shape[0], shape[2]) for shape, _ in spy.calls) == [(1, 48), (2, 16), (2, 32)]
        assert all(m is None for _, m in spy.calls)  # causal without a mask tensor

    @pytest.mark.parametrize("window", [1, 3, 6])
    def test_sliding_window_uses_per_document_bands(self, monkeypatch, window):
        spy = _SdpaSpy(monkeypatch)
        q, k, v = (t.requires_grad_() for t in _qkv(seq=sum(LENGTHS)))
        mask = _packed(LENGTHS, sliding_window=window)
        out = sdpa_attention(q, k, v, mask, 0.25)
        # no (T, T) mask: buckets no longer than the window run causal, the others an (L, L) band (L = 16 here)
        assert all(m is None or m == (shape[2], shape[2]) for shape, m in spy.calls)
        assert {shape[2] for shape, m in spy.calls if m is not None} == {16}
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref = eager_attention(*inputs, mask, 0.25)  # one call with the full (T, T) mask
        # fp32, different kernels (SDPA vs matmul + softmax): 1e-6 absolute on O(1) values.
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(grad)
        for ours, theirs in zip((q, k, v), inputs):
            torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-6, rtol=1e-6)

    def test_bounds_only_on_device_use_the_explicit_mask(self):
        q, k, v = _qkv()
        mask = SPECS["packed"]
        no_host_bounds = AttentionMaskSpec(cu_seq_lens=mask.cu_seq_lens, max_seq_len=9)
        no_host_bounds.doc_bounds = None  # as for a CUDA ``cu_seq_lens`` built without ``doc_bounds``
        torch.testing.assert_close(
            sdpa_attention(q, k, v, no_host_bounds, 0.25), sdpa_attention(q, k, v, mask, 0.25), atol=1e-6, rtol=1e-6
        )

    def test_doc_bounds_derived_only_from_host_tensors(self):
        assert AttentionMaskSpec(cu_seq_lens=torch.tensor([0, 3, 5])).doc_bounds == [0, 3, 5]
        # a device tensor (meta stands in for CUDA here) is never read back: reading it would sync (meta: raise)
        assert AttentionMaskSpec(cu_seq_lens=torch.tensor([0, 3, 5], device="meta")).doc_bounds is None

    def test_banded_mask_is_shared_across_layers(self):
        mask = _packed([4, 4], sliding_window=2)
        band = mask.with_window(2).banded_causal_mask(4, torch.device("cpu"))
        assert band is mask.with_window(2).banded_causal_mask(4, torch.device("cpu"))
        expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
        assert torch.equal(band, expected)


class TestCpuShortDocumentsInFp32:
    def test_short_bf16_documents_are_attended_in_fp32_and_cast_back(self):
        from xtl.ops.attention import AttentionMaskSpec, sdpa_attention

        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 4, 96, 16, generator=generator) for _ in range(3))
        mask = AttentionMaskSpec(doc_bounds=[0, 30, 60, 96])
        out = sdpa_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.25)
        reference = sdpa_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), mask, 0.25)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, reference.bfloat16()), "fp32 math on the bf16 inputs, rounded once at the end"


class TestBucketPlanAcrossModes:
    def test_a_plan_made_in_inference_mode_serves_a_training_step(self) -> None:
        """Lightning evaluates under ``torch.inference_mode``; a training step with the same packing reuses the
        cached plan, whose index tensors must then not be inference tensors."""
        from xtl.ops.attention import attend_by_document_length

        bounds = [0, 3, 7, 8, 13]  # a packing no other test uses

        def attend(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

        with torch.inference_mode():
            q = torch.randn(1, 2, 13, 4)
            attend_by_document_length(q, q, q, bounds, attend, bucket=4)
        q = torch.randn(1, 2, 13, 4, requires_grad=True)
        attend_by_document_length(q, q, q, bounds, attend, bucket=4).sum().backward()
        assert q.grad is not None


class TestDecodingMasks:
    """One query over cached keys (a decoding step): the masks shared by the layers of the forward."""

    @pytest.mark.parametrize("window", [None, 3, 50])
    def test_one_query_mask_equals_the_general_formula(self, window) -> None:
        padding = torch.ones(3, 9, dtype=torch.bool)
        padding[0, :4] = False
        spec = AttentionMaskSpec(padding_mask=padding, sliding_window=window)
        k_idx = torch.arange(9)
        allowed = (k_idx <= 8) & (k_idx > 8 - (window or 9))
        expected = allowed[None, None, None, :] & padding[:, None, None, :]
        assert torch.equal(spec.boolean_mask(3, 1, torch.device("cpu"), 9), expected)

    def test_sdpa_mask_gives_the_boolean_masks_output_and_is_built_once(self) -> None:
        torch.manual_seed(0)
        q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 9, 8), torch.randn(3, 2, 9, 8)
        padding = torch.ones(3, 9, dtype=torch.bool)
        padding[1, :5] = False
        spec = AttentionMaskSpec(padding_mask=padding)
        additive = spec.sdpa_mask(3, 1, torch.float32, torch.device("cpu"), 9)
        assert spec.sdpa_mask(3, 1, torch.float32, torch.device("cpu"), 9) is additive
        assert spec.with_window(None) is spec  # the layers share the spec and its masks
        allowed = spec.boolean_mask(3, 1, torch.device("cpu"), 9)
        boolean = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        out = sdpa_attention(q, k, v, spec, 8**-0.5)
        assert torch.equal(out, boolean.transpose(1, 2))
        torch.testing.assert_close(out, _reference(q, k, v, allowed, 8**-0.5))
