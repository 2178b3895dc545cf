"""Triton rotary position embedding for ``q`` and ``k`` in one kernel, with its backward.

Same math as :func:`xtl.ops.rope.apply_rotary_pos_emb` (rotate-half convention): with ``x = (x1, x2)`` and
``cos = (c1, c2)``, ``sin = (s1, s2)`` split into halves of the last dimension,
``out = (x1 * c1 - x2 * s1, x2 * c2 + x1 * s2)``. One program handles one ``(batch, position)``: it loads that
position's ``cos``/``sin`` once and rotates every head of ``q`` and of ``k`` (their head counts may differ, GQA).
Products are computed in fp32 and rounded once to the output dtype. ``q``/``k`` may have any strides (xtl passes
transposed ``(B, T, H, D) -> (B, H, T, D)`` views); outputs are allocated with the inputs' memory layout.

The backward is the transpose rotation, ``grad_x = (g1 * c1 + g2 * s2, g2 * c2 - g1 * s1)`` (rope with ``-sin``
when the two halves of ``sin`` are equal, as in every HF rope table); ``cos``/``sin`` get no gradient.

:func:`xtl.ops.rope.apply_rotary_pos_emb_triton` wraps this kernel as a drop-in for the torch op (``(B, T, H, D)``
inputs, and inputs the kernel does not cover, handled there).

With ``TRITON_INTERPRET=1`` set before triton is imported, the kernel runs in triton's interpreter on CPU tensors
(how the tests check it without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embeddings on ``q`` ``(B, Hq, T, D)`` and ``k`` ``(B, Hk, T, D)`` with ``cos``/``sin`` ``(B, T, D)``.

    Differentiable in ``q`` and ``k``; ``cos``/``sin`` get no gradient.

    Args:
        q: Queries (fp32, bf16 or fp16; any strides).
        k: Keys: the dtype, batch, positions and (even) head dim of ``q``; any head count.
        cos: Cosine table, broadcastable to ``(B, T, D)``.
        sin: Sine table, broadcastable to ``(B, T, D)``.

    Returns:
        The rotated ``q`` and ``k`` with the inputs' memory layout, in the dtype torch promotes ``q``, ``cos`` and
        ``sin`` to (that of ``q`` where all match).

    Raises:
        ValueError: For shapes or dtypes the kernel does not cover.
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] % 2 or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"rope kernel needs q, k (B, H, T, D) with an even D; got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.dtype != k.dtype or any(t.dtype not in _DTYPES for t in (q, cos, sin)):
        raise ValueError(f"rope kernel needs float q, k of one dtype; got {q.dtype}, {k.dtype}")
    batch, _, seq, dim = q.shape
    return _TritonRope.apply(q, k, cos.expand(batch, seq, dim), sin.expand(batch, seq, dim))


class _TritonRope(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: ANN001
        ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = (q.dtype, k.dtype)
        out_dtype = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)
        return _rope(q, k, cos, sin, out_dtype, backward=False)

    @staticmethod
    def backward(  # noqa: ANN001
        ctx, grad_q: torch.Tensor, grad_k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        q_dtype, k_dtype = ctx.dtypes
        grad_q_in, grad_k_in = _rope(grad_q, grad_k, cos, sin, q_dtype, backward=True, k_dtype=k_dtype)
        return grad_q_in, grad_k_in, None, None


def _rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dtype: torch.dtype,
    backward: bool,
    k_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_out = torch.empty_like(q, dtype=dtype)  # keeps the layout of a dense (e.g. transposed) input
    k_out = torch.empty_like(k, dtype=k_dtype or dtype)
    batch, heads_q, seq, dim = q.shape
    heads_k = k.shape[1]
    if q.numel() == 0 and k.numel() == 0:
        return q_out, k_out
    half = dim // 2
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(heads_q, heads_k)), max(1, 2048 // block_d)))
    _rope_kernel[(batch * seq,)](
        q, k, q_out, k_out, cos, sin, seq, heads_q, heads_k,
        *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(), *cos.stride(), *sin.stride(),
        HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, BACKWARD=backward,
    )  # fmt: skip
    return q_out, k_out


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, T, HQ, HK,
    sqb, sqh, sqt, sqd, skb, skh, skt, skd,
    soqb, soqh, soqt, soqd, sokb, sokh, sokt, sokd,
    scb, sct, scd, ssb, sst, ssd,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    cos_row = cos_ptr + b * scb + t * sct
    sin_row = sin_ptr + b * ssb + t * sst
    c1 = tl.load(cos_row + d * scd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + (d + HALF) * scd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + d * ssd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + (d + HALF) * ssd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr + b * sqb + t * sqt, qo_ptr + b * soqb + t * soqt, HQ, sqh, sqd, soqh, soqd,
        c1, c2, s1, s2, d, d_mask, HALF, BLOCK_H, BACKWARD,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + b * skb + t * skt, ko_ptr + b * sokb + t * sokt, HK, skh, skd, sokh, sokd,
        c1, c2, s1, s2, d, d_mask, HALF, BLOCK_H, BACKWARD,
    )  # fmt: skip


@triton.jit
def _rotate_heads(
    x_row, o_row, H, sxh, sxd, soh, sod, c1, c2, s1, s2, d, d_mask,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h[:, None] < H) & d_mask[None, :]
        x_base = x_row + h[:, None] * sxh
        x1 = tl.load(x_base + d[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_base + (d[None, :] + HALF) * sxd, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        else:
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
        o_base = o_row + h[:, None] * soh
        tl.store(o_base + d[None, :] * sod, o1.to(o_row.dtype.element_ty), mask=mask)
        tl.store(o_base + (d[None, :] + HALF) * sod, o2.to(o_row.dtype.element_ty), mask=mask)
