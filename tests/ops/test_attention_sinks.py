"""The eager attention's sink path is transformers' GPT-OSS eager attention, forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from xtl.ops.attention import AttentionMaskSpec, eager_attention, sdpa_attention


class _Module(nn.Module):
    def __init__(self, sinks: torch.Tensor, groups: int) -> None:
        super().__init__()
        self.sinks = sinks
        self.num_key_value_groups = groups


class TestEagerSinks:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("window", [None, 5])
    def test_bitwise_equal_to_gpt_oss_eager(self, dtype, window):
        torch.manual_seed(0)
        q = torch.randn(2, 4, 12, 16, dtype=dtype, requires_grad=True)
        k = torch.randn(2, 2, 12, 16, dtype=dtype, requires_grad=True)
        v = torch.randn(2, 2, 12, 16, dtype=dtype, requires_grad=True)
        sinks = torch.randn(4, dtype=dtype, requires_grad=True)
        spec = AttentionMaskSpec(sliding_window=window)
        ours = eager_attention(q, k, v, spec, 0.25, sinks=sinks)
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        module = _Module(inputs[3], groups=2).eval()
        mask = spec.additive_mask(2, 12, dtype, q.device)
        theirs, _ = eager_attention_forward(module, *inputs[:3], mask, scaling=0.25)
        assert torch.equal(ours, theirs)
        grad = torch.randn_like(ours)
        ours.backward(grad)
        theirs.backward(grad)
        for a, b in zip((q, k, v, sinks), inputs):
            assert torch.equal(a.grad, b.grad)

    def test_sinks_take_probability_mass(self):
        torch.manual_seed(0)
        q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        plain = eager_attention(q, k, v, AttentionMaskSpec(), 0.3)
        with_sink = eager_attention(q, k, v, AttentionMaskSpec(), 0.3, sinks=torch.full((2,), -1e4))
        torch.testing.assert_close(plain, with_sink)  # a sink of -inf weight changes nothing
        damped = eager_attention(q, k, v, AttentionMaskSpec(), 0.3, sinks=torch.full((2,), 1e4))
        assert damped.abs().max() < 1e-6  # a dominant sink absorbs all attention
        assert torch.equal(
            sdpa_attention(q, k, v, AttentionMaskSpec(), 0.3, sinks=torch.zeros(2)),
            eager_attention(q, k, v, AttentionMaskSpec(), 0.3, sinks=torch.zeros(2)),
        )


class TestPackedSinks:
    """Sinks over a packed batch run eager attention per document group: no ``(T, T)`` mask, same result."""

    # fp32: the same eager op order per document; only the matmul shapes differ from one (T, T) call: 1e-6 abs.
    @pytest.mark.parametrize("window", [None, 3])
    def test_matches_full_mask_eager(self, monkeypatch, window):
        lengths = [5, 7, 5, 3, 7, 1]
        bounds = [0, 5, 12, 17, 20, 27, 28]
        spec = AttentionMaskSpec(
            cu_seq_lens=torch.tensor(bounds, dtype=torch.int32), max_seq_len=7, sliding_window=window
        )
        torch.manual_seed(0)
        q = torch.randn(1, 4, 28, 16, requires_grad=True)
        k = torch.randn(1, 2, 28, 16, requires_grad=True)
        v = torch.randn(1, 2, 28, 16, requires_grad=True)
        sinks = torch.randn(4, requires_grad=True)
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        ref = eager_attention(*inputs[:3], spec, 0.25, sinks=inputs[3])

        mask_rows = []
        boolean_mask = AttentionMaskSpec.boolean_mask

        def spy(self, batch, seq_len, device, kv_len=None):
            mask_rows.append(seq_len)
            return boolean_mask(self, batch, seq_len, device, kv_len)

        monkeypatch.setattr(AttentionMaskSpec, "boolean_mask", spy)
        out = sdpa_attention(q, k, v, spec, 0.25, sinks=sinks)
        # one (L, L) mask per length bucket (lengths padded to multiples of 16), none (T, T)
        assert sorted(mask_rows) == sorted({-(-n // 16) * 16 for n in lengths})
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(grad)
        for ours, theirs in zip((q, k, v, sinks), inputs):
            torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-6, rtol=1e-6)
