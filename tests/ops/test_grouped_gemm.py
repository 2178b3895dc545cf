"""Grouped GEMM implementations against a per-expert loop reference, including experts without rows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xtl.ops.grouped_gemm import (
    get_grouped_gemm_fn,
    grouped_gemm_auto,
    grouped_gemm_loop,
    grouped_gemm_torch,
    grouped_gemm_triton,
)

COUNTS = [[5, 0, 12, 3], [0, 0, 7, 0], [0, 0, 0, 0]]


def _reference(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Plain per-expert products written out row block by row block."""
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=torch.float64)
    start = 0
    for expert, n in enumerate(counts):
        out[start : start + n] = x[start : start + n].double() @ w[expert].double()
        start += n
    return out


def _run(fn, counts: list[int], dtype: torch.dtype = torch.float32, device: str = "cpu", transposed: bool = True):
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 24, dtype=dtype, device=device, requires_grad=True)
    param = torch.randn(len(counts), 40, 24, dtype=dtype, device=device, requires_grad=True)  # (E, N, K)
    w = param.transpose(1, 2) if transposed else param.detach().transpose(1, 2).contiguous().requires_grad_()
    out = fn(x, w, torch.tensor(counts, device=device))
    grad = torch.randn_like(out)
    out.backward(grad)
    w_grad = param.grad.transpose(1, 2) if transposed else w.grad
    return x, w, out, grad, x.grad, w_grad


def check_against_reference(impl, counts: list[int], transposed: bool = True, atol: float = 1e-5) -> None:
    """Output, input gradient and weight gradient of ``impl`` against fp64 per-expert products.

    fp32 tolerance: each implementation reduces over K (forward) or over rows (weight gradient) in its own
    order; against fp64 the error of these 24/40/20-term fp32 dot products is below 1e-5.
    """
    x, w, out, grad, x_grad, w_grad = _run(impl, counts, transposed=transposed)
    torch.testing.assert_close(out.double(), _reference(x, w, counts), atol=atol, rtol=0)
    torch.testing.assert_close(x_grad.double(), _reference(grad, w.transpose(1, 2), counts), atol=atol, rtol=0)
    start = 0
    for expert, n in enumerate(counts):
        expected = x[start : start + n].detach().double().t() @ grad[start : start + n].double()
        torch.testing.assert_close(w_grad[expert].double(), expected, atol=atol, rtol=0)
        start += n


class TestGroupedGemm:
    @pytest.mark.parametrize("counts", COUNTS)
    @pytest.mark.parametrize("impl", [grouped_gemm_loop, grouped_gemm_torch], ids=["loop", "torch"])
    @pytest.mark.parametrize("transposed", [True, False], ids=["w_view", "w_contiguous"])
    def test_forward_and_gradients_match_the_reference(self, impl, counts, transposed):
        check_against_reference(impl, counts, transposed)

    def test_triton_kernel_under_the_interpreter(self):
        # TRITON_INTERPRET must be set before triton is imported, hence a fresh interpreter process.
        pytest.importorskip("triton")
        script = (
            "from tests.ops.test_grouped_gemm import COUNTS, check_against_reference\n"
            "from xtl.ops.grouped_gemm import grouped_gemm_triton\n"
            "for counts in COUNTS[:2]:\n"
            "    for transposed in (True, False):\n"
            "        check_against_reference(grouped_gemm_triton, counts, transposed)\n"
        )
        env = {**os.environ, "TRITON_INTERPRET": "1", "XTL_HF_IMPL": "0"}
        root = Path(__file__).resolve().parents[2]
        result = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]

    def test_loop_is_exactly_the_per_expert_matmul(self):
        x, w, out, grad, _, _ = _run(grouped_gemm_loop, COUNTS[0])
        assert torch.equal(out[5:17], x[5:17] @ w[2])

    def test_selector(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        assert get_grouped_gemm_fn() is grouped_gemm_auto
        assert get_grouped_gemm_fn("triton") is grouped_gemm_triton
        monkeypatch.setenv("XTL_HF_IMPL", "1")
        assert get_grouped_gemm_fn("triton") is grouped_gemm_loop
        with pytest.raises(ValueError, match="unknown grouped gemm"):
            get_grouped_gemm_fn("cutlass")

    def test_auto_is_the_loop_on_cpu(self):
        x, w = torch.randn(6, 8), torch.randn(2, 8, 4)
        counts = torch.tensor([2, 4])
        assert torch.equal(grouped_gemm_auto(x, w, counts), grouped_gemm_loop(x, w, counts))

    def test_bad_shapes_are_rejected(self):
        with pytest.raises(ValueError, match="sums to 5"):
            grouped_gemm_loop(torch.randn(6, 8), torch.randn(2, 8, 4), torch.tensor([2, 3]))
        with pytest.raises(ValueError, match="w \\(E, K, N\\)"):
            grouped_gemm_loop(torch.randn(6, 8), torch.randn(2, 4, 8), torch.tensor([2, 4]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestGroupedGemmGPU:
    # bf16 inputs, fp32 accumulation in every implementation: results differ from the loop reference by the
    # final bf16 rounding of outputs and gradients (relative 2**-8), so the bound is relative 1e-2.
    @pytest.mark.parametrize("impl", [grouped_gemm_torch, grouped_gemm_triton, grouped_gemm_auto])
    @pytest.mark.parametrize("counts", [[64, 0, 130, 7], [0, 0, 33, 0]])
    def test_matches_the_loop_in_bf16(self, impl, counts):
        if impl is grouped_gemm_torch and torch.cuda.get_device_capability() < (9, 0):
            pytest.skip("torch._grouped_mm needs sm90+")
        got = _run(impl, counts, torch.bfloat16, "cuda")
        ref = _run(grouped_gemm_loop, counts, torch.bfloat16, "cuda")
        for a, b in zip(got[2:], ref[2:]):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=1e-2)
