"""Triton residual add + RMSNorm in one pass over each row, with its backward.

Forward, per row: ``summed = residual + x`` (rounded to the input dtype, as the unfused add is), then with
transformers' op order ``h = summed.float(); n = h * rsqrt(mean(h^2) + eps); normed = weight * n.to(dtype)``
(the product in the dtype torch promotes ``weight`` and ``summed`` to). ``summed`` and the per-row ``rsqrt`` are
kept for the backward, which recomputes ``n`` and gives, per row,
``grad_summed = rstd * (gn - n * mean(gn * n)) + grad_summed_out`` with ``gn = grad_normed * weight``; ``x`` and
``residual`` both receive ``grad_summed``, and ``weight`` the sum over rows of ``grad_normed * n`` (partial sums
per program in fp32, added up once). All statistics and products are fp32.

With ``TRITON_INTERPRET=1`` set before triton is imported, the kernels run in triton's interpreter on CPU tensors
(how the tests check them without a GPU). :func:`xtl.ops.rms_norm.add_rms_norm_triton` wraps this kernel as a
drop-in for :func:`xtl.ops.rms_norm.add_rms_norm_torch` (inputs the kernel does not cover handled there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_WIDTH = 65536  # one row lives in one program's registers


def triton_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``summed = residual + x`` and RMSNorm of ``summed`` over the last dimension; returns ``(normed, summed)``.

    Differentiable in ``x``, ``residual`` and ``weight``.

    Args:
        x: The branch output ``(..., C)`` (fp32, bf16 or fp16; any strides), ``C`` at most 65536.
        residual: The residual stream, same shape and dtype as ``x``.
        weight: The norm's scale ``(C,)``; ``normed`` is in the dtype torch promotes it and ``x`` to.
        eps: Added to the mean square before the ``rsqrt``.

    Raises:
        ValueError: For shapes or dtypes the kernel does not cover.
    """
    if not add_rms_norm_supported(x, residual, weight):
        raise ValueError(
            f"add+rms_norm kernel needs x, residual of one shape and float dtype and weight (C,) with C <= "
            f"{MAX_WIDTH}; got {tuple(x.shape)} {x.dtype}, {tuple(residual.shape)} {residual.dtype}, "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    return _TritonAddRMSNorm.apply(x, residual, weight, float(eps))


def add_rms_norm_supported(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`triton_add_rms_norm` covers these inputs (same shape and float dtype, ``weight (C,)``)."""
    if x.dim() == 0 or x.shape != residual.shape or weight.shape != (x.shape[-1],) or x.shape[-1] > MAX_WIDTH:
        return False
    if x.dtype != residual.dtype or x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        return False
    return residual.device == x.device == weight.device


class _TritonAddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: ANN001
        ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape, width = x.shape, x.shape[-1]
        x2d = x.reshape(-1, width).contiguous()
        r2d = residual.reshape(-1, width).contiguous()
        rows = x2d.shape[0]
        summed = torch.empty_like(x2d)
        normed = torch.empty(rows, width, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            block, warps = _block(width)
            _add_rms_norm_fwd_kernel[(rows,)](
                x2d, r2d, weight.contiguous(), normed, summed, rstd, width, eps, BLOCK_N=block, num_warps=warps
            )
        ctx.save_for_backward(summed, weight, rstd)
        ctx.set_materialize_grads(False)
        return normed.view(shape), summed.view(shape)

    @staticmethod
    def backward(  # noqa: ANN001
        ctx, grad_normed: torch.Tensor | None, grad_summed: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        summed, weight, rstd = ctx.saved_tensors
        rows, width = summed.shape
        shape = grad_normed.shape if grad_normed is not None else grad_summed.shape
        if grad_normed is None:  # only ``summed`` was used: the norm adds nothing
            grad_in = grad_summed.to(summed.dtype)
            return grad_in, grad_in, None, None
        need_weight = ctx.needs_input_grad[2]
        grad_normed = grad_normed.reshape(rows, width).contiguous()
        grad_summed_2d = grad_normed if grad_summed is None else grad_summed.reshape(rows, width).contiguous()
        grad_in = torch.empty_like(summed)
        programs = _programs(rows, summed.device)
        partial = torch.empty(programs if need_weight else 1, width, dtype=torch.float32, device=summed.device)
        if rows:
            block, warps = _block(width)
            _add_rms_norm_bwd_kernel[(programs,)](
                grad_normed, grad_summed_2d, summed, weight.contiguous(), rstd, grad_in, partial, rows, width,
                HAS_GRAD_SUMMED=grad_summed is not None, NEED_WEIGHT=need_weight, BLOCK_N=block, num_warps=warps,
            )  # fmt: skip
        else:
            partial.zero_()
        grad_weight = partial.sum(0).to(weight.dtype) if need_weight else None
        grad_in = grad_in.view(shape)
        return grad_in, grad_in, grad_weight, None


def _block(width: int) -> tuple[int, int]:
    block = triton.next_power_of_2(width)
    return block, min(max(block // 256, 1), 16)


def _programs(rows: int, device: torch.device) -> int:
    """Programs of the backward: each accumulates the weight gradient of its rows, so few enough to sum cheaply."""
    if device.type == "cuda":
        return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(rows, 4))


@triton.jit
def _add_rms_norm_fwd_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, rstd_ptr, N, eps, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    offs = row * N + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    summed = (r + x).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + offs, summed, mask=mask)
    h = summed.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    tl.store(rstd_ptr + row, rstd)
    normed = (h * rstd).to(s_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_bwd_kernel(
    gy_ptr, gs_ptr, s_ptr, w_ptr, rstd_ptr, gin_ptr, gw_ptr, M, N,
    HAS_GRAD_SUMMED: tl.constexpr, NEED_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    grad_w = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid.to(tl.int64) * N  # int64 offsets: rows * N may pass 2**31
    row_step = programs.to(tl.int64) * N
    for row in range(pid, M, programs):
        offs = row_start + cols
        row_start += row_step
        gy = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        n = h * rstd
        if NEED_WEIGHT:
            grad_w += gy * n.to(s_ptr.dtype.element_ty).to(tl.float32)
        gn = gy * w
        grad = rstd * (gn - n * (tl.sum(gn * n, axis=0) / N))
        if HAS_GRAD_SUMMED:
            grad += tl.load(gs_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(gin_ptr + offs, grad.to(gin_ptr.dtype.element_ty), mask=mask)
    if NEED_WEIGHT:
        tl.store(gw_ptr + pid.to(tl.int64) * N + cols, grad_w, mask=mask)
