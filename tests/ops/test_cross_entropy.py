"""Loss ops: the fused chunked head+loss equals the unfused path."""

from __future__ import annotations

import pytest
import torch

from xtl.ops.cross_entropy import causal_lm_loss, cross_entropy_sum, linear_cross_entropy, lm_head_loss, shift_labels


def _case(dtype):
    torch.manual_seed(0)
    hidden = torch.randn(2, 33, 16, dtype=dtype, requires_grad=True)
    weight = (0.3 * torch.randn(50, 16, dtype=dtype)).requires_grad_()
    targets = torch.randint(0, 50, (2, 33))
    targets[0, :5] = -100
    targets[1, -1] = -100
    return hidden, weight, targets


class TestLinearCrossEntropy:
    # fp32: identical per-token math, different summation order (chunks): 1e-5 relative.
    # bf16: the weight gradient is accumulated in fp32 across chunks (the unfused path sums in one bf16 matmul),
    # so gradients differ by bf16 rounding: 2e-2 relative.
    @pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=str)
    @pytest.mark.parametrize("chunk_bytes", [200 * 4, 50 * 4 * 1000])
    def test_matches_unfused_loss_and_grads(self, dtype, tol, chunk_bytes):
        hidden, weight, targets = _case(dtype)
        loss, count = linear_cross_entropy(hidden, weight, targets, chunk_bytes=chunk_bytes)
        (loss * 0.5).backward()
        grads = hidden.grad.clone(), weight.grad.clone()
        hidden.grad = weight.grad = None
        ref, ref_count = cross_entropy_sum(hidden @ weight.t(), targets)
        (ref * 0.5).backward()
        assert int(count) == int(ref_count) == 2 * 33 - 6
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[0], hidden.grad, rtol=tol, atol=tol)
        torch.testing.assert_close(grads[1], weight.grad, rtol=tol, atol=tol)

    def test_no_grad_and_frozen_weight(self):
        hidden, weight, targets = _case(torch.float32)
        weight.requires_grad_(False)
        loss, _ = linear_cross_entropy(hidden, weight, targets)
        loss.backward()
        assert hidden.grad is not None and weight.grad is None
        with torch.no_grad():
            assert linear_cross_entropy(hidden, weight, targets)[0].requires_grad is False


class TestLMHeadLoss:
    def test_training_path_returns_no_logits_and_same_loss(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        hidden, weight, targets = _case(torch.float32)
        logits, loss, loss_sum, count = lm_head_loss(hidden, weight, targets, return_logits=False)
        assert logits is None
        ref_loss, ref_sum, ref_count = causal_lm_loss(hidden @ weight.t(), targets)
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(loss_sum, ref_sum)
        assert int(count) == int(ref_count)

    def test_all_ignored_gives_zero_loss(self):
        hidden, weight, _ = _case(torch.float32)
        targets = torch.full((2, 33), -100)
        _, loss, loss_sum, count = lm_head_loss(hidden, weight, targets, return_logits=False)
        assert float(loss) == 0.0 and float(loss_sum) == 0.0 and int(count) == 0

    def test_shift_labels(self):
        assert shift_labels(torch.tensor([[1, 2, 3]])).tolist() == [[2, 3, -100]]
