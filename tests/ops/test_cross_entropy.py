"""Loss ops: the fused chunked head+loss equals the unfused path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from xtl.ops.cross_entropy import causal_lm_loss, cross_entropy_sum, linear_cross_entropy, lm_head_loss, shift_labels


def _case(dtype):
    torch.manual_seed(0)
    hidden = torch.randn(2, 33, 16, dtype=dtype, requires_grad=True)
    weight = (0.3 * torch.randn(50, 16, dtype=dtype)).requires_grad_()
    targets = torch.randint(0, 50, (2, 33))
    targets[0, :5] = -100
    targets[1, -1] = -100
    return hidden, weight, targets


class _CountMatmuls(TorchDispatchMode):
    """Counts the matrix products dispatched inside the block."""

    OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += func in self.OPS
        return func(*args, **(kwargs or {}))


class _RecordOutputs(TorchDispatchMode):
    """Records ``(shape, dtype)`` of every tensor produced inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.outputs.add((t.shape, t.dtype))
        return out


def _rel_err(actual, expected):
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


class TestLinearCrossEntropy:
    # fp32: identical per-token math, different summation order (chunks): 1e-5 relative.
    # bf16: the weight gradient is summed over chunks in bf16 (the unfused path sums in one bf16 matmul), so
    # gradients differ by bf16 rounding: 2e-2 relative.
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

    # 66 rows in chunks of 10: 7 chunks, one logits matmul each; gradients add two more per chunk.
    def test_no_gradient_work_without_grad(self):
        hidden, weight, targets = _case(torch.float32)
        chunk_bytes = 10 * 50 * 4
        for grad_mode, needs_grad, matmuls in [(False, True, 7), (True, False, 7), (True, True, 21)]:
            h, w = hidden.detach().requires_grad_(needs_grad), weight.detach().requires_grad_(needs_grad)
            with torch.set_grad_enabled(grad_mode), _CountMatmuls() as counter:
                loss, _ = linear_cross_entropy(h, w, targets, chunk_bytes=chunk_bytes)
            assert counter.count == matmuls, (grad_mode, needs_grad)
            assert loss.requires_grad == (grad_mode and needs_grad)
            torch.testing.assert_close(loss, cross_entropy_sum(hidden.detach() @ weight.detach().t(), targets)[0])

    def test_weight_grad_accumulates_in_weight_dtype(self):
        torch.manual_seed(0)
        hidden = torch.randn(512, 32, dtype=torch.bfloat16, requires_grad=True)
        weight = (0.3 * torch.randn(100, 32, dtype=torch.bfloat16)).requires_grad_()
        targets = torch.randint(0, 100, (512,))
        with _RecordOutputs() as recorded:
            loss, _ = linear_cross_entropy(hidden, weight, targets, chunk_bytes=32 * 100 * 4)  # 16 chunks
        assert (torch.Size([100, 32]), torch.float32) not in recorded.outputs  # no fp32 V x C accumulator
        loss.backward()
        assert weight.grad.dtype == torch.bfloat16
        # fp32-accumulated reference: the same bf16 per-chunk products summed in fp32
        h = hidden.detach()
        grad_logits = torch.func.grad(lambda x: cross_entropy_sum(x, targets)[0])(h @ weight.detach().t())
        reference = sum((grad_logits[i : i + 32].t() @ h[i : i + 32]).float() for i in range(0, 512, 32))
        # bf16 sum over 16 chunks, one bf16 rounding each: relative error 5e-3 measured; bound 1e-2.
        assert _rel_err(weight.grad, reference) <= 1e-2

    def test_under_cpu_autocast(self):
        hidden, weight, targets = _case(torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = linear_cross_entropy(hidden, weight, targets, chunk_bytes=10 * 50 * 4)
            loss.backward()
            grads = hidden.grad.clone(), weight.grad.clone()
            hidden.grad = weight.grad = None
            ref, _ = cross_entropy_sum(F.linear(hidden, weight), targets)  # unfused, same autocast
            ref.backward()
        assert loss.dtype == torch.float32
        assert grads[0].dtype == grads[1].dtype == torch.float32  # gradients in the parameters' dtypes
        # Same bf16 logits and fp32 loss math: 1e-5. The hidden gradient is per token (same bf16 product): 1e-5.
        # The weight gradient sums bf16 per-chunk products in fp32 where the reference rounds one bf16 product
        # over all tokens: 1e-2 relative (measured 2e-3).
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-5)
        assert _rel_err(grads[1], weight.grad) <= 1e-2


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
