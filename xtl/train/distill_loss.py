"""The generalized Jensen-Shannon divergence of on-policy distillation (GKD), on logits or chunked from heads.

:func:`generalized_jsd_loss` is TRL's ``GKDTrainer.generalized_jsd_loss`` (Agarwal et al., 2024, eq. 1) with the same
conventions, plus an optional top-k restriction: with student log-probabilities ``S`` and teacher log-probabilities
``T`` (``log_softmax(logits / temperature)``) and the mixture ``M = log((1 - beta) exp(S) + beta exp(T))``, each
token's divergence is

- ``beta == 0``: ``KL(teacher || student) = sum p_T (T - S)`` (forward KL),
- ``beta == 1``: ``KL(student || teacher) = sum p_S (S - T)`` (reverse KL),
- otherwise: ``beta KL(teacher || M) + (1 - beta) KL(student || M)``.

(As in TRL the two ends are their own branches: the mixture formula itself tends to 0 at both ends.) ``batchmean``
divides the sum over the supervised tokens (``labels != -100``) and the vocabulary by the number of those tokens.

``top_k``: both distributions are restricted to the teacher's ``top_k`` most likely tokens of each position and
renormalized there (``log_softmax`` of the ``top_k`` gathered logits of each model); the divergence is then the one
above over those ``top_k`` tokens. Tokens outside the teacher's top ``k`` get no gradient; there is no tail bucket.
``top_k`` of the vocabulary size or more is the full divergence.

:func:`chunked_jsd_sum` is the same sum over tokens computed a chunk of tokens at a time from the final hidden states
and the two heads, without holding either model's vocabulary-wide logits for all tokens (module memory note there).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from xtl.data.item import IGNORE_INDEX

Reduction = Literal["batchmean", "sum", "mean", "none"]


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: Reduction = "batchmean",
    top_k: int | None = None,
) -> torch.Tensor:
    """The generalized JSD of TRL's GKD between two models' logits (module docstring), reduced as TRL reduces it.

    Args:
        student_logits: ``(..., V)`` the student's logits (with gradient).
        teacher_logits: ``(..., V)`` the teacher's logits, same shape.
        labels: ``(...)`` targets, ``-100`` at positions that are left out (``None``: every position counts).
        beta: Interpolation between forward KL (0) and reverse KL (1).
        temperature: Both logits are divided by it before the softmax.
        reduction: ``batchmean`` (sum over kept tokens and vocabulary / kept tokens, at least 1; without ``labels``
            / the first dimension, as TRL), ``sum``, ``mean`` (over kept elements, TRL's ``jsd.mean()``) or ``none``
            (the elements: ``(kept tokens, V)`` with ``labels``, else ``(..., V)``).
        top_k: Restrict both distributions to the teacher's ``top_k`` tokens per position (module docstring).

    Returns:
        The loss (a scalar, or the per-element divergence for ``none``), in fp32 or the logits' wider dtype.
    """
    elements = _divergence(student_logits, teacher_logits, beta, temperature, top_k)
    if labels is not None:
        mask = labels != IGNORE_INDEX
        elements = elements[mask]
        count = mask.sum().clamp_min(1)
    else:  # TRL divides by the first dimension (the batch of a (B, T, V) input)
        count = max(elements.shape[0], 1)
    if reduction == "batchmean":
        return elements.sum() / count
    if reduction == "sum":
        return elements.sum()
    if reduction == "mean":
        return elements.mean()
    if reduction == "none":
        return elements
    raise ValueError(f"reduction must be batchmean, sum, mean or none, got {reduction!r}")


def token_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> torch.Tensor:
    """Each position's generalized JSD (summed over the vocabulary, or the teacher's top ``k``): ``(...)``."""
    return _divergence(student_logits, teacher_logits, beta, temperature, top_k).sum(-1)


def chunked_jsd_sum(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = None,
    student_weight: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    chunk_bytes: int = 64 * 2**20,
) -> torch.Tensor:
    """The summed generalized JSD of the positions ``mask`` keeps, a chunk of positions at a time.

    Each side is given either as final hidden states with its head's weight (logits ``hidden @ weight.T``, computed
    per chunk in the hidden states' dtype) or as logits (``weight=None``). Per position the math is that of
    :func:`token_jsd` in fp32 (fp64 for fp64 inputs). Gradients flow to ``student`` and ``student_weight`` only;
    they are computed chunk by chunk during the forward (each chunk's logits are differentiated right away and
    freed) and scaled by the incoming gradient in backward, so no chunk is recomputed. The teacher never gets a
    gradient.

    Memory, ``N`` positions, ``V`` vocabulary, ``C`` hidden size, ``R = chunk_bytes / (4 V)`` positions per chunk:
    the vocabulary-wide tensors alive at once are one chunk's, about fifteen ``R x V`` fp32 buffers at
    ``0 < beta < 1`` (counted from the operations: both models' logits and log-probabilities, the stacked mixture
    terms, the mixture, the two KL terms and their weighted copies, then their gradients; fewer at ``beta`` 0 or 1),
    i.e. about ``15 * chunk_bytes`` (about 1 GiB at the default 64 MiB), whatever ``N``. Held from forward to
    backward: the gradient of ``student`` (``N x C``, or ``N x V`` when the student is given as logits) and of
    ``student_weight`` (``V x C`` in its dtype). The plain path (both models' ``N x V`` logits, then
    :func:`generalized_jsd_loss`) holds the same fifteen-odd buffers at ``N x V`` each.

    Args:
        student: ``(..., C)`` student hidden states (with ``student_weight``) or ``(..., V)`` student logits.
        teacher: ``(..., C_t)`` teacher hidden states (with ``teacher_weight``) or ``(..., V)`` teacher logits.
        mask: ``(...)`` bool, the positions that count.
        beta: As :func:`generalized_jsd_loss`.
        temperature: As :func:`generalized_jsd_loss`.
        top_k: As :func:`generalized_jsd_loss`.
        student_weight: ``(V, C)`` the student's head (``None``: ``student`` holds logits).
        teacher_weight: ``(V, C_t)`` the teacher's head (``None``: ``teacher`` holds logits).
        chunk_bytes: About the size of one chunk's fp32 logits of one model.

    Returns:
        The sum over kept positions (a scalar, fp32 or fp64); divide by their count for TRL's ``batchmean``.
    """
    vocab = student_weight.shape[0] if student_weight is not None else student.shape[-1]
    rows = max(1, chunk_bytes // (4 * vocab))
    settings = (float(beta), float(temperature), top_k, rows)
    if torch.is_grad_enabled() and (
        student.requires_grad or (student_weight is not None and student_weight.requires_grad)
    ):
        return _ChunkedJSD.apply(student, student_weight, teacher, teacher_weight, mask, settings)
    with torch.no_grad():
        loss, _, _ = _chunked(student, student_weight, teacher, teacher_weight, mask, settings, False, False)
    return loss


# ---- private ---------------------------------------------------------------------------------------------------


def _divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float,
    temperature: float,
    top_k: int | None,
) -> torch.Tensor:
    """The per-element divergence ``(..., V)`` (``(..., top_k)`` with ``top_k``), TRL's operations in TRL's order."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ; "
            "the teacher must share the student's vocabulary"
        )
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student_logits, teacher_logits = student_logits.to(dtype), teacher_logits.to(dtype)
    if top_k is not None and top_k < teacher_logits.shape[-1]:
        index = teacher_logits.topk(top_k, dim=-1).indices
        student_logits, teacher_logits = student_logits.gather(-1, index), teacher_logits.gather(-1, index)
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        return F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    if beta == 1:
        return F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    weight = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
    mixture = torch.logsumexp(
        torch.stack([student_log_probs + torch.log1p(-weight), teacher_log_probs + torch.log(weight)]), dim=0
    )
    kl_teacher = F.kl_div(mixture, teacher_log_probs, reduction="none", log_target=True)
    kl_student = F.kl_div(mixture, student_log_probs, reduction="none", log_target=True)
    return weight * kl_teacher + (1 - weight) * kl_student


def _chunked(
    student: torch.Tensor,
    student_weight: torch.Tensor | None,
    teacher: torch.Tensor,
    teacher_weight: torch.Tensor | None,
    mask: torch.Tensor,
    settings: tuple[float, float, int | None, int],
    need_student: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(loss_sum, grad_student, grad_weight)`` of the summed divergence, ``rows`` positions at a time."""
    beta, temperature, top_k, rows = settings
    flat_s = student.reshape(-1, student.shape[-1])
    flat_t = teacher.reshape(-1, teacher.shape[-1])
    keep = mask.reshape(-1).to(flat_s.device, torch.bool)
    n = flat_s.shape[0]
    if flat_t.shape[0] != n or keep.numel() != n:
        raise ValueError(f"student ({n}), teacher ({flat_t.shape[0]}) and mask ({keep.numel()}) positions differ")
    grad_s = torch.empty_like(flat_s) if need_student else None
    grad_w = torch.zeros_like(student_weight) if need_weight else None
    loss = torch.zeros((), dtype=torch.promote_types(flat_s.dtype, torch.float32), device=flat_s.device)
    differentiate = need_student or need_weight
    for start in range(0, n, rows):
        chunk = slice(start, start + rows)
        s_in = flat_s[chunk].detach()
        with torch.no_grad():
            t_logits = flat_t[chunk] if teacher_weight is None else flat_t[chunk] @ teacher_weight.to(flat_t.dtype).t()
        with torch.enable_grad() if differentiate else torch.no_grad():
            s_logits = s_in if student_weight is None else s_in @ student_weight.detach().to(s_in.dtype).t()
            s_logits = s_logits.detach().requires_grad_(differentiate)
            per_token = token_jsd(s_logits, t_logits, beta, temperature, top_k)
            chunk_loss = torch.where(keep[chunk], per_token, 0.0).sum()
        loss += chunk_loss.detach().to(loss.dtype)
        if not differentiate:
            continue
        (grad_logits,) = torch.autograd.grad(chunk_loss, s_logits)
        if student_weight is None:
            grad_s[chunk] = grad_logits.to(flat_s.dtype)
            continue
        grad_logits = grad_logits.to(s_in.dtype)
        if need_student:
            grad_s[chunk] = grad_logits @ student_weight.detach().to(s_in.dtype)
        if need_weight:
            grad_w += (grad_logits.t() @ s_in).to(grad_w.dtype)
    return loss, grad_s, grad_w


class _ChunkedJSD(torch.autograd.Function):
    """:func:`chunked_jsd_sum` with the gradients computed in forward (``ctx`` keeps them, not the logits)."""

    @staticmethod
    def forward(ctx, student, student_weight, teacher, teacher_weight, mask, settings):  # noqa: ANN001, ANN205
        need_student = ctx.needs_input_grad[0]
        need_weight = student_weight is not None and ctx.needs_input_grad[1]
        loss, grad_s, grad_w = _chunked(
            student, student_weight, teacher, teacher_weight, mask, settings, need_student, need_weight
        )
        ctx.student_shape = student.shape
        ctx.save_for_backward(
            grad_s if grad_s is not None else torch.empty(0), grad_w if grad_w is not None else torch.empty(0)
        )
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # noqa: ANN001, ANN205
        grad_s, grad_w = ctx.saved_tensors
        out_s = (grad_s * grad_loss.to(grad_s.dtype)).view(ctx.student_shape) if ctx.needs_input_grad[0] else None
        out_w = grad_w * grad_loss.to(grad_w.dtype) if ctx.needs_input_grad[1] else None
        return out_s, out_w, None, None, None, None
