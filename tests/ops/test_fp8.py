"""Tests for ``xtl.ops.fp8``: the blockwise quantizers, the reference path of the blockwise fp8 linear, and torchao's
triton quantize kernels (the GPU path) against the reference under ``TRITON_INTERPRET=1``.

Tolerances: quantization is compared bitwise (fp8 bytes and float32 scales); an fp8 matmul differs from the exact
one by the operands' rounding (3 mantissa bits: relative error of each element at most 2**-4, about 2-4% in norm),
so the reference path must land within 5% of ``F.linear`` and exactly on the matmul of the dequantized operands.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from xtl.ops.fp8 import (
    BLOCK,
    blockwise_fp8_linear,
    blockwise_fp8_path,
    dequantize_blockwise,
    quantize_1x128,
    quantize_128x128,
)

ROOT = Path(__file__).resolve().parents[2]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).float().norm() / b.float().norm())


def _fake_1x128(x: torch.Tensor) -> torch.Tensor:
    return dequantize_blockwise(*quantize_1x128(x), block=(1, BLOCK))


def _fake_128x128(w: torch.Tensor) -> torch.Tensor:
    return dequantize_blockwise(*quantize_128x128(w))


class TestQuantize:
    def test_1x128_scales_each_group_by_its_amax(self):
        x = torch.randn(4, 256)
        x[1, 128:] *= 1000.0  # one loud group must not change the others
        q, scale_inv = quantize_1x128(x)
        assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (4, 2)
        amax = x.abs().view(4, 2, BLOCK).amax(-1)
        torch.testing.assert_close(scale_inv, amax / 448.0, rtol=1e-6, atol=0)
        assert torch.equal(q.float().abs().view(4, 2, BLOCK).amax(-1), torch.full((4, 2), 448.0))
        assert torch.equal(quantize_1x128(x[:1])[0].view(torch.uint8), q[:1].view(torch.uint8))

    def test_128x128_scales_and_round_trip_bound(self):
        w = torch.randn(256, 384)
        q, scale_inv = quantize_128x128(w)
        assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 3)
        err = (dequantize_blockwise(q, scale_inv) - w).abs()
        # e4m3 normals: half a unit in the last place is at most 2**-4 relative; subnormals: 2**-10 * scale.
        bound = 2.0**-4 * w.abs() + 2.0**-10 * scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        assert bool((err <= bound).all())
        assert float(err.max()) > 0, "fp8 must round something"

    def test_dequantize_broadcasts_partial_blocks(self):
        q = torch.ones(3, 5).to(torch.float8_e4m3fn)
        out = dequantize_blockwise(q, torch.tensor([[2.0, 4.0]]), block=(4, 3))
        assert torch.equal(out, torch.tensor([[2.0, 2, 2, 4, 4]] * 3))


class TestBlockwiseLinearReference:
    def test_the_cpu_path_is_the_reference(self):
        assert blockwise_fp8_path("cpu") == "reference"

    def test_forward_is_the_matmul_of_the_dequantized_operands(self):
        x, w = torch.randn(256, 128), 0.05 * torch.randn(384, 128)
        out = blockwise_fp8_linear(x, w)
        assert torch.equal(out, _fake_1x128(x) @ _fake_128x128(w).t())
        assert 1e-3 < _rel(out, F.linear(x, w)) < 0.05

    def test_gradients_quantize_along_the_contracting_dims(self):
        """grad_x = q(g, 1x128 along N) @ q(W); grad_W = q(g.T, 1x128 along tokens) @ q(x.T, 1x128 along tokens).T."""
        x = torch.randn(256, 128, requires_grad=True)
        w = (0.05 * torch.randn(256, 128)).requires_grad_()
        g = torch.randn(256, 256)
        blockwise_fp8_linear(x, w).backward(g)
        assert torch.equal(x.grad, _fake_1x128(g) @ _fake_128x128(w.detach()))
        assert torch.equal(w.grad, _fake_1x128(g.t()) @ _fake_1x128(x.detach().t()).t())
        assert _rel(w.grad, g.t() @ x.detach()) < 0.05

    def test_tokens_are_padded_to_whole_groups_and_bias_is_added(self):
        x, w, b = torch.randn(2, 100, 128), 0.05 * torch.randn(128, 128), torch.randn(128)
        padded = F.pad(x.reshape(200, 128), (0, 0, 0, 56))
        expected = (blockwise_fp8_linear(padded, w)[:200] + b).view(2, 100, 128)
        assert torch.equal(blockwise_fp8_linear(x, w, b), expected)

    def test_weight_dims_must_be_multiples_of_128(self):
        with pytest.raises(ValueError, match="multiples of 128"):
            blockwise_fp8_linear(torch.randn(4, 128), torch.randn(64, 128))


class TestTritonKernelsInterpreter:
    def test_torchao_quantize_kernels_match_the_reference(self):
        """torchao's triton kernels of the GPU path (1x128 activations, 128x1 activations, 128x128 weights) give
        the reference's fp8 bytes and scales bitwise. Run in a fresh process (``TRITON_INTERPRET`` is read when
        triton is imported) with one autotune config (the interpreter cannot benchmark). The interpreter's own
        float -> fp8 cast is not round-to-nearest-even (triton 3.9 ``_convert_float`` rounds half up and drops the
        carry into the exponent), so the script replaces it with torch's RNE cast, which is what the GPU's
        ``cvt.rn.satfinite`` does. The transposed kernels do not run in the interpreter and are checked on GPU."""
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        script = ROOT / "tests" / "ops" / "fp8_interpreter_check.py"
        result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        assert result.stdout.count("bitwise equal") == 3, result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="sm90")
class TestBlockwiseLinearGPU:
    def test_torchao_kernels_match_the_reference_bitwise(self):
        from torchao.prototype.blockwise_fp8_training import kernels

        x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
        pairs = [
            (kernels.triton_fp8_blockwise_act_quant_lhs(x), quantize_1x128(x.cpu())),
            (kernels.triton_fp8_blockwise_act_quant_rhs(x), [t.t() for t in quantize_1x128(x.cpu().t())]),
            (kernels.triton_fp8_blockwise_act_quant_transposed_lhs(x), quantize_1x128(x.cpu().t())),
            (kernels.triton_fp8_blockwise_weight_quant_rhs(x[:, :256]), quantize_128x128(x[:, :256].cpu())),
        ]
        for (q, s), (q_ref, s_ref) in pairs:
            assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
            assert torch.equal(s.cpu(), s_ref)

    def test_gpu_path_matches_the_reference(self):
        """Same quantization, different accumulation order and a bf16 output: within 1e-2 relative."""
        x = torch.randn(300, 256, dtype=torch.bfloat16, requires_grad=True)
        w = (0.05 * torch.randn(384, 256)).to(torch.bfloat16).requires_grad_()
        g = torch.randn(300, 384, dtype=torch.bfloat16)
        results = []
        for device in ("cpu", "cuda"):
            xd, wd = x.detach().to(device).requires_grad_(), w.detach().to(device).requires_grad_()
            out = blockwise_fp8_linear(xd, wd)
            out.backward(g.to(device))
            results.append([t.cpu().float() for t in (out, xd.grad, wd.grad)])
        assert blockwise_fp8_path("cuda") == "torchao"
        for ref, got in zip(*results):
            assert _rel(got, ref) < 1e-2
