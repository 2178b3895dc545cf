"""Causal-LM cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xtl.ops.selector import hf_impl_enabled

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Turn HF-style labels (``labels[t]`` = token t) into targets (``out[t]`` = token t+1), padding the end."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def causal_lm_loss(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean loss, summed loss, supervised token count)`` of shifted ``targets``.

    Under ``XTL_HF_IMPL`` the mean is transformers' exact op (fp32 ``cross_entropy`` with mean reduction) and the
    sum is derived from it; otherwise the sum is computed directly and the mean derived (0 when no token counts).
    """
    if hf_impl_enabled():
        loss = cross_entropy_mean(logits, targets, ignore_index)
        num_tokens = (targets != ignore_index).sum()
        return loss, loss * num_tokens, num_tokens
    loss_sum, num_tokens = cross_entropy_sum(logits, targets, ignore_index)
    return loss_sum / num_tokens.clamp(min=1), loss_sum, num_tokens


def cross_entropy_sum(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies in fp32 and the number of supervised tokens.

    Args:
        logits: ``(..., V)`` logits in any dtype (upcast to fp32 as transformers does).
        targets: ``(...)`` target ids, ``ignore_index`` where no loss.

    Returns:
        ``(loss_sum, num_tokens)``.
    """
    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).to(flat_logits.device)
    loss_sum = F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index, reduction="sum")
    return loss_sum, (flat_targets != ignore_index).sum()


def cross_entropy_mean(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean token cross-entropy in fp32, the exact op of transformers' ``ForCausalLMLoss``."""
    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat_logits, targets.reshape(-1).to(flat_logits.device), ignore_index=ignore_index)


def lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None,
    return_logits: bool = True,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """LM head and causal-LM loss: ``(logits, loss, loss_sum, num_tokens)``.

    When logits are not needed (training) and ``XTL_HF_IMPL`` is off, the head and the loss run fused and chunked
    (:func:`linear_cross_entropy`): full fp32 logits are never materialized. Otherwise logits are computed and
    the loss is :func:`causal_lm_loss`.

    Args:
        hidden: Final hidden states ``(..., C)``.
        weight: LM head weight ``(V, C)``.
        targets: Shifted targets ``(...)`` or ``None`` for no loss.
        return_logits: Whether the caller needs the logits.
        ignore_index: Target value that carries no loss.
    """
    if targets is None or return_logits or hf_impl_enabled():
        logits = F.linear(hidden, weight)
        if targets is None:
            return logits, None, None, None
        loss, loss_sum, num_tokens = causal_lm_loss(logits, targets, ignore_index)
        return (logits if return_logits else None), loss, loss_sum, num_tokens
    loss_sum, num_tokens = linear_cross_entropy(hidden, weight, targets, ignore_index=ignore_index)
    return None, loss_sum / num_tokens.clamp(min=1), loss_sum, num_tokens


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_bytes: int = 256 * 2**20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of ``hidden @ weight.T`` against ``targets`` without materializing all logits.

    Rows are processed in chunks whose fp32 logits take about ``chunk_bytes``. When gradients are wanted, those of
    the summed loss with respect to ``hidden`` and ``weight`` are computed chunk by chunk during forward and scaled
    by the incoming gradient in backward; under ``torch.no_grad()`` (or with neither input requiring grad) only the
    loss is computed. Per-token math equals the unfused path: compute-dtype matmul (the autocast dtype inside an
    autocast region, else the inputs' dtype), fp32 log-softmax, fp32 logit gradient cast to the compute dtype.

    The weight gradient is accumulated across chunks in the weight's dtype (no fp32 ``V x C`` buffer, 2.5 GB on
    Qwen3-8B). For fp32 weights it is the same fp32 sum as before (bitwise on CPU). For bf16 weights each chunk
    adds one bf16 rounding, so the relative error against an fp32 accumulation grows with the number of chunks
    (measured 5e-3 at 16 chunks, 9e-3 at 64; the tests bound it by 1e-2). Under autocast with fp32 weights the
    bf16 per-chunk products are summed in fp32.

    Args:
        hidden: Hidden states ``(..., C)``.
        weight: LM head weight ``(V, C)``.
        targets: Target ids ``(...)``, ``ignore_index`` where no loss.
        ignore_index: Target value that carries no loss.
        chunk_bytes: Approximate size of one chunk's fp32 logits.

    Returns:
        ``(loss_sum, num_tokens)``; ``loss_sum`` is fp32. Gradients have the dtypes of ``hidden`` and ``weight``.
    """
    rows = max(1, chunk_bytes // (weight.shape[0] * 4))
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, targets, rows, ignore_index)
    loss_sum, num_tokens, _, _ = _chunked_loss_and_grads(hidden, weight, targets, rows, ignore_index, False, False)
    return loss_sum, num_tokens


def _chunked_loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    rows: int,
    ignore_index: int,
    need_h: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(loss_sum, num_tokens, grad_hidden, grad_weight)`` of the summed loss, ``rows`` tokens at a time.

    Runs with autocast off and the matmuls in the compute dtype: the autocast dtype when ``hidden``'s device is
    in an autocast region, else ``hidden.dtype``. ``grad_hidden`` is flat ``(N, C)`` in ``hidden.dtype``;
    ``grad_weight`` is in ``weight.dtype``, summed over chunks in that dtype.
    """
    device_type = hidden.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1).to(hidden.device)
    w = weight.to(compute)
    n = flat_h.shape[0]
    # all rows in one chunk when they fit: no Python loop over the row count, which a compiled caller would
    # specialize on (one compile per count)
    chunks = [slice(None)] if n <= rows else [slice(start, start + rows) for start in range(0, n, rows)]
    grad_h = torch.empty_like(flat_h) if need_h and len(chunks) > 1 else None
    grad_w = None
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    with torch.autocast(device_type, enabled=False):
        for chunk in chunks:
            h = flat_h[chunk].to(compute)
            t = flat_t[chunk]
            valid = t != ignore_index
            safe_t = torch.where(valid, t, 0)
            logits = (h @ w.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe_t[:, None]).squeeze(1)
            loss_sum += torch.where(valid, lse - picked, 0.0).sum()
            if not (need_h or need_w):
                continue
            grad_logits = logits.sub_(lse[:, None]).exp_()
            grad_logits[torch.arange(t.numel(), device=t.device), safe_t] -= 1.0
            grad_logits.mul_(valid[:, None])
            grad_logits = grad_logits.to(compute)
            if need_h and grad_h is None:  # the only chunk
                grad_h = (grad_logits @ w).to(flat_h.dtype)
            elif need_h:
                grad_h[chunk] = grad_logits @ w
            if need_w:
                grad_w = _accumulate(grad_w, grad_logits.t(), h, weight.dtype)
    if need_w and grad_w is None:  # no rows
        grad_w = torch.zeros_like(weight)
    return loss_sum, (flat_t != ignore_index).sum(), grad_h, grad_w


def _accumulate(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``acc + a @ b`` in ``dtype``: in place (one ``addmm_``, no temporary) when ``a``/``b`` are of that dtype."""
    if acc is None:
        return (a @ b).to(dtype)
    if a.dtype == dtype:
        return acc.addmm_(a, b)
    return acc.add_(a @ b)  # mixed precision (autocast): the product in the compute dtype, the sum in ``dtype``


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, ignore_index):  # noqa: ANN001, ANN205
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss_sum, num_tokens, grad_h, grad_w = _chunked_loss_and_grads(
            hidden, weight, targets, rows, ignore_index, need_h, need_w
        )
        ctx.hidden_shape = hidden.shape
        ctx.save_for_backward(grad_h if need_h else torch.empty(0), grad_w if need_w else torch.empty(0))
        return loss_sum, num_tokens

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):  # noqa: ANN001, ANN205
        grad_h, grad_w = ctx.saved_tensors
        out_h = (grad_h * grad_loss.to(grad_h.dtype)).view(ctx.hidden_shape) if ctx.needs_input_grad[0] else None
        out_w = grad_w * grad_loss.to(grad_w.dtype) if ctx.needs_input_grad[1] else None
        return out_h, out_w, None, None, None
