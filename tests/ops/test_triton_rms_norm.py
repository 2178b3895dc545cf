"""The triton residual add + RMSNorm kernel against the unfused torch ops, and its selector."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xtl.ops import get_add_rms_norm_fn
from xtl.ops.rms_norm import add_rms_norm_fused, add_rms_norm_torch, add_rms_norm_triton, rms_norm_hf

# (leading dims, hidden size, weight in fp32 whatever the input dtype, grad of ``summed`` too)
CASES = [((2, 5), 64, False, True), ((7,), 48, True, True), ((1, 3), 128, False, False), ((2, 3), 96, False, True)]
EPS = 1e-6


def check_add_rms_norm_kernel(device: str = "cpu", cases: list[tuple] = CASES) -> None:
    """``(normed, summed)`` and the gradients of ``x``, ``residual``, ``weight`` against the torch reference.

    Tolerances: fp32 inputs -- same ops in fp32, only the order of the mean-square sum and the weight-gradient sum
    over rows differ: ``atol = rtol = 1e-5`` (``summed`` is bitwise). bf16 inputs, against the reference run in fp32
    on the same (upcast) values: the kernel rounds ``summed``, the normalized row and the scaled output to bf16, at
    most one bf16 ulp (``2**-7`` relative; triton's interpreter truncates where the GPU rounds) each, so
    ``rtol = 2**-7`` for ``summed`` and ``2**-6`` for ``normed``, per element. The input gradient
    ``rstd * (gn - n * mean(gn * n))`` cancels, and the weight gradient sums over rows, so their error is relative
    to the largest entry: ``atol = 2**-6 * max|reference|`` with ``rtol = 2**-6``. Half-precision rounding against
    transformers' own op order: ``_check_op_order``.
    """
    from xtl.ops.triton_rms_norm import triton_add_rms_norm

    for dtype in (torch.float32, torch.bfloat16):
        for lead, width, fp32_weight, grad_summed in cases:
            x, residual, weight = _inputs(lead, width, dtype, torch.float32 if fp32_weight else dtype, device)
            normed, summed = triton_add_rms_norm(x, residual, weight, EPS)
            assert type(normed.grad_fn).__name__ == "_TritonAddRMSNormBackward"  # the kernel, not the fallback
            ref_normed, ref_summed = add_rms_norm_torch(x, residual, weight, EPS)
            assert normed.shape == summed.shape == x.shape
            assert (normed.dtype, summed.dtype) == (ref_normed.dtype, ref_summed.dtype)
            grads = _grads(normed, summed, grad_summed, (x, residual, weight))
            ref_inputs = [t.detach().float().requires_grad_() for t in (x, residual, weight)]
            ref_normed, ref_summed = add_rms_norm_torch(*ref_inputs, EPS)
            ref_grads = _grads(ref_normed, ref_summed, grad_summed, ref_inputs, like=(normed, summed))
            case = f"{dtype} {lead} {width} fp32_weight={fp32_weight} grad_summed={grad_summed}"
            names = ("summed", "normed", "x", "residual", "weight")
            out_dtype = torch.promote_types(weight.dtype, dtype)
            expected_dtypes = dict(summed=dtype, normed=out_dtype, x=dtype, residual=dtype, weight=weight.dtype)
            for name, a, b in zip(names, (summed, normed, *grads), (ref_summed, ref_normed, *ref_grads)):
                assert a.dtype == expected_dtypes[name], name
                if dtype == torch.float32:
                    tol = dict(atol=0.0, rtol=0.0) if name == "summed" else dict(atol=1e-5, rtol=1e-5)
                elif name in ("summed", "normed"):
                    tol = dict(atol=1e-6, rtol=2**-7 if name == "summed" else 2**-6)
                else:
                    tol = dict(atol=2**-6 * b.abs().max().item(), rtol=2**-6)
                torch.testing.assert_close(a.float(), b, **tol, msg=lambda m, label=f"{name} {case}": f"{label}: {m}")
    _check_op_order(device)
    _check_other_inputs(device)


class TestTritonAddRMSNorm:
    def test_torch_reference_is_the_unfused_add_then_norm(self):
        # the op the selector gives off CUDA must be bitwise what the unfused code computes
        for dtype in (torch.float32, torch.bfloat16):
            x, residual, weight = _inputs((2, 5), 64, dtype, dtype, "cpu")
            normed, summed = add_rms_norm_torch(x, residual, weight, EPS)
            grad_normed, grad_summed = torch.randn_like(normed), torch.randn_like(summed)
            grads = torch.autograd.grad((normed, summed), (x, residual, weight), (grad_normed, grad_summed))
            ref_summed = residual + x
            ref_normed = rms_norm_hf(ref_summed, weight, EPS)
            ref_grads = torch.autograd.grad(
                (ref_normed, ref_summed), (x, residual, weight), (grad_normed, grad_summed)
            )
            for a, b in zip((normed, summed, *grads), (ref_normed, ref_summed, *ref_grads)):
                assert a.dtype == b.dtype and torch.equal(a, b)

    def test_selector_gives_the_torch_reference_on_cpu(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        assert get_add_rms_norm_fn(torch.device("cpu")) is add_rms_norm_torch
        assert get_add_rms_norm_fn(None) is add_rms_norm_torch

    def test_selector_gives_the_torch_reference_under_hf_impl(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "1")
        assert get_add_rms_norm_fn(torch.device("cuda")) is add_rms_norm_torch
        assert get_add_rms_norm_fn(torch.device("cpu")) is add_rms_norm_torch

    def test_selector_on_cuda_without_triton_keeps_the_cuda_norm(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a)
        )
        assert get_add_rms_norm_fn(torch.device("cuda")) is add_rms_norm_fused

    def test_selector_gives_the_triton_kernel_on_cuda(self, monkeypatch):
        pytest.importorskip("triton")
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        assert get_add_rms_norm_fn(torch.device("cuda")) is add_rms_norm_triton

    def test_kernel_rejects_what_it_does_not_cover(self):
        pytest.importorskip("triton")
        from xtl.ops.triton_rms_norm import triton_add_rms_norm

        x, weight = torch.randn(3, 8), torch.ones(8)
        with pytest.raises(ValueError, match="one shape"):
            triton_add_rms_norm(x, x[:1], weight, EPS)
        with pytest.raises(ValueError, match="one shape"):
            triton_add_rms_norm(x, x.double(), weight, EPS)

    def test_triton_kernel_under_the_interpreter(self):
        # TRITON_INTERPRET must be set before triton is imported, hence a fresh interpreter process.
        pytest.importorskip("triton")
        script = "from tests.ops.test_triton_rms_norm import check_add_rms_norm_kernel\ncheck_add_rms_norm_kernel()\n"
        env = {**os.environ, "TRITON_INTERPRET": "1", "XTL_HF_IMPL": "0"}
        root = Path(__file__).resolve().parents[2]
        result = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestTritonAddRMSNormGPU:
    def test_matches_the_torch_reference(self):
        check_add_rms_norm_kernel("cuda", CASES + [((4, 1000), 4096, False, True), ((3, 77), 5120, True, True)])

    def test_selected_on_cuda(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        assert get_add_rms_norm_fn(torch.device("cuda")) is add_rms_norm_triton


def _inputs(
    lead: tuple[int, ...], width: int, dtype: torch.dtype, weight_dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(width + len(lead))
    x = torch.randn(*lead, width, generator=gen).to(device, dtype).requires_grad_()
    residual = (3 * torch.randn(*lead, width, generator=gen)).to(device, dtype).requires_grad_()
    weight = (1 + 0.2 * torch.randn(width, generator=gen)).to(device, weight_dtype).requires_grad_()
    return x, residual, weight


def _grads(
    normed: torch.Tensor,
    summed: torch.Tensor,
    grad_summed: bool,
    inputs: tuple[torch.Tensor, ...] | list[torch.Tensor],
    like: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of ``inputs`` for output gradients drawn from a seed (``like``: the dtypes to draw them in)."""
    gen = torch.Generator().manual_seed(7)
    outs = like if like is not None else (normed, summed)
    grad_n = torch.randn(normed.shape, generator=gen).to(normed.device, outs[0].dtype).to(normed.dtype)
    grad_s = torch.randn(summed.shape, generator=gen).to(summed.device, outs[1].dtype).to(summed.dtype)
    if grad_summed:
        return torch.autograd.grad((normed, summed), inputs, (grad_n, grad_s))
    return torch.autograd.grad(normed, inputs, grad_n)


def _check_op_order(device: str) -> None:
    """In half precision the kernel rounds where transformers' ops do: equal to them but for rare ``rstd`` ulps.

    ``summed`` is one rounding of the fp32 sum either way (bitwise); the normalized row is rounded to the input dtype
    before the scale multiplies it, as in :func:`~xtl.ops.rms_norm.rms_norm_hf`, so ``normed`` matches the torch op
    in the input dtype except where the two ``rsqrt`` of the mean square differ by an fp32 ulp and move the row
    across a rounding boundary (none seen; at most 1% allowed, each within one ulp). fp16 only under the
    interpreter, which truncates to bf16 where the GPU rounds to nearest.
    """
    from xtl.ops.triton_rms_norm import triton_add_rms_norm

    dtypes = (torch.float16, torch.bfloat16) if device == "cuda" else (torch.float16,)
    for dtype in dtypes:
        for weight_dtype in (dtype, torch.float32):
            x, residual, weight = _inputs((4, 5), 64, dtype, weight_dtype, device)
            normed, summed = triton_add_rms_norm(x, residual, weight, EPS)
            ref_normed, ref_summed = add_rms_norm_torch(x, residual, weight, EPS)
            assert torch.equal(summed, ref_summed), (dtype, weight_dtype)
            assert (normed != ref_normed).float().mean().item() <= 0.01, (dtype, weight_dtype)
            torch.testing.assert_close(normed, ref_normed, atol=0.0, rtol=2**-7 if dtype == torch.bfloat16 else 2**-10)


def _check_other_inputs(device: str) -> None:
    """Only ``summed`` used, a frozen weight, non-contiguous inputs, and what goes to the torch fallback."""
    from xtl.ops.triton_rms_norm import triton_add_rms_norm

    x, residual, weight = _inputs((4,), 32, torch.float32, torch.float32, device)
    _, summed = triton_add_rms_norm(x, residual, weight, EPS)
    grad = torch.randn_like(summed)
    gx, gr = torch.autograd.grad(summed, (x, residual), grad)
    assert torch.equal(gx, grad) and torch.equal(gr, grad)
    frozen = weight.detach()
    xt = x.detach().t().contiguous().t().requires_grad_()  # column-major
    normed, _ = triton_add_rms_norm(xt, residual, frozen, EPS)
    ref, _ = add_rms_norm_torch(xt, residual, frozen, EPS)
    grad = torch.randn_like(normed)
    torch.testing.assert_close(normed, ref, atol=1e-5, rtol=1e-5)
    got_grads = torch.autograd.grad(normed, (xt, residual), grad)
    for a, b in zip(got_grads, torch.autograd.grad(ref, (xt, residual), grad)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # a residual broadcast over rows: the unfused ops
    normed, summed = add_rms_norm_triton(x, residual[:1], weight, EPS)
    ref_normed, ref_summed = add_rms_norm_fused(x, residual[:1], weight, EPS)
    assert torch.equal(normed, ref_normed) and torch.equal(summed, ref_summed)
