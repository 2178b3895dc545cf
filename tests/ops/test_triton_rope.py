"""The triton rotary embedding kernel against :func:`xtl.ops.rope.apply_rotary_pos_emb`, and its selector."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xtl.ops import get_rope_fn
from xtl.ops.rope import apply_rotary_pos_emb, apply_rotary_pos_emb_triton

# (B, T, Hq, Hk, D, cos batch): GQA and MHA heads, odd T, head dims 32/64/128, a table shared over the batch
SHAPES = [(2, 7, 4, 2, 64, 2), (1, 5, 3, 1, 32, 1), (2, 3, 2, 2, 128, 1)]


def check_rope_kernel(device: str = "cpu", shapes: list[tuple[int, ...]] = SHAPES) -> None:
    """Forward and ``q``/``k`` gradients of the triton kernel against the torch op in fp32.

    Tolerances: fp32 inputs -- the kernel does the torch op's products and sum in fp32 (possibly fused into FMAs on
    a GPU), so the error is a few fp32 ulps of values below ~8: ``atol = rtol = 1e-5``. bf16 inputs -- the kernel
    computes in fp32 from the bf16 values and rounds once, so against the fp32 torch op on the same (upcast) values
    each element is off by at most one bf16 ulp, ``2**-7`` of its magnitude (triton's interpreter truncates where
    the GPU rounds to nearest, so one ulp, not half): ``rtol = 2**-7`` plus ``atol = 1e-5`` for the fp32 part.
    """
    for dtype, tol in ((torch.float32, dict(atol=1e-5, rtol=1e-5)), (torch.bfloat16, dict(atol=1e-5, rtol=2**-7))):
        for shape in shapes:
            q, k, cos, sin = _inputs(shape, dtype, device)
            q_out, k_out = apply_rotary_pos_emb_triton(q, k, cos, sin)
            assert type(q_out.grad_fn).__name__ == "_TritonRopeBackward"  # the kernel, not the torch fallback
            assert q_out.shape == q.shape and k_out.shape == k.shape
            assert q_out.dtype == k_out.dtype == dtype
            assert q_out.stride() == q.stride() and k_out.stride() == k.stride()  # the input's (B, T, H, D) layout
            grad_q, grad_k = torch.randn_like(q_out), torch.randn_like(k_out)
            got = (q_out, k_out, *torch.autograd.grad((q_out, k_out), (q, k), (grad_q, grad_k)))
            q32, k32 = (t.detach().float().requires_grad_() for t in (q, k))
            ref_q, ref_k = apply_rotary_pos_emb(q32, k32, cos.float(), sin.float())
            ref = (ref_q, ref_k, *torch.autograd.grad((ref_q, ref_k), (q32, k32), (grad_q.float(), grad_k.float())))
            for name, a, b in zip(("q", "k", "grad_q", "grad_k"), got, ref):
                assert a.dtype == dtype, name
                torch.testing.assert_close(a.float(), b, **tol, msg=lambda m, n=name, s=shape: f"{n} {s}: {m}")
    _check_other_inputs(device)


class TestTritonRope:
    def test_selector_gives_the_torch_op_on_cpu(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        assert get_rope_fn(torch.device("cpu")) is apply_rotary_pos_emb
        assert get_rope_fn(None) is apply_rotary_pos_emb

    def test_selector_gives_the_torch_op_under_hf_impl(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "1")
        assert get_rope_fn(torch.device("cuda")) is apply_rotary_pos_emb

    def test_selector_gives_the_torch_op_on_cuda_without_triton(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a)
        )
        assert get_rope_fn(torch.device("cuda")) is apply_rotary_pos_emb

    def test_selector_gives_the_triton_kernel_on_cuda(self, monkeypatch):
        pytest.importorskip("triton")
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        assert get_rope_fn(torch.device("cuda")) is apply_rotary_pos_emb_triton

    def test_kernel_rejects_what_it_does_not_cover(self):
        pytest.importorskip("triton")
        from xtl.ops.triton_rope import triton_rotary_pos_emb

        q, k, cos, sin = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8)
        with pytest.raises(ValueError, match="even D"):
            triton_rotary_pos_emb(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7])
        with pytest.raises(ValueError, match="one dtype"):
            triton_rotary_pos_emb(q, k.double(), cos, sin)

    def test_triton_kernel_under_the_interpreter(self):
        # TRITON_INTERPRET must be set before triton is imported, hence a fresh interpreter process.
        pytest.importorskip("triton")
        script = "from tests.ops.test_triton_rope import check_rope_kernel\ncheck_rope_kernel()\n"
        env = {**os.environ, "TRITON_INTERPRET": "1", "XTL_HF_IMPL": "0"}
        root = Path(__file__).resolve().parents[2]
        result = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestTritonRopeGPU:
    def test_matches_the_torch_op(self):
        check_rope_kernel("cuda", SHAPES + [(4, 513, 32, 8, 128, 4), (2, 1000, 16, 16, 64, 1)])

    def test_selected_on_cuda(self, monkeypatch):
        monkeypatch.setenv("XTL_HF_IMPL", "0")
        assert get_rope_fn(torch.device("cuda")) is apply_rotary_pos_emb_triton


def _inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``/``k`` as xtl passes them (transposed ``(B, T, H, D)`` views) and HF-style ``cos``/``sin`` tables."""
    batch, seq, heads_q, heads_k, dim, table_batch = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(batch, seq, heads_q, dim, generator=gen).to(device, dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(batch, seq, heads_k, dim, generator=gen).to(device, dtype).transpose(1, 2).requires_grad_()
    angles = torch.rand(table_batch, seq, dim // 2, generator=gen) * 20
    emb = torch.cat((angles, angles), dim=-1).to(device)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def _check_other_inputs(device: str) -> None:
    """``(B, T, H, D)`` inputs (``unsqueeze_dim=2``), tables with unequal halves, and what goes to the torch op."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 3, 16, generator=gen).to(device).requires_grad_()
    k = torch.randn(2, 5, 1, 16, generator=gen).to(device).requires_grad_()
    cos, sin = torch.randn(2, 2, 5, 16, generator=gen).to(device)  # halves differ: the exact transpose is needed
    got = apply_rotary_pos_emb_triton(q, k, cos, sin, unsqueeze_dim=2)
    grads = torch.randn_like(got[0]), torch.randn_like(got[1])
    ref = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(got, (q, k), grads), torch.autograd.grad(ref, (q, k), grads)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # odd head dim, and tables that require grad: the torch op itself (bitwise, tables get their gradient)
    odd_q, odd_k, odd_cos, odd_sin = (t.detach()[..., :15] for t in (q, k, cos, sin))
    for a, b in zip(
        apply_rotary_pos_emb_triton(odd_q, odd_k, odd_cos, odd_sin, 2),
        apply_rotary_pos_emb(odd_q, odd_k, odd_cos, odd_sin, 2),
    ):
        assert torch.equal(a, b)
    cos.requires_grad_()
    got = apply_rotary_pos_emb_triton(q, k, cos, sin, unsqueeze_dim=2)
    ref = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    assert torch.equal(torch.autograd.grad(got[0].sum(), cos)[0], torch.autograd.grad(ref[0].sum(), cos)[0])
