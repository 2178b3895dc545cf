"""Muon for hidden weight matrices and AdamW for every other parameter, as one torch optimizer.

Muon (momentum orthogonalized by Newton-Schulz) updates a weight matrix ``W`` (``m x n``) with its gradient ``G``::

    B <- momentum * B + (1 - momentum) * G                   (the momentum buffer; torch's ``lerp``)
    U <- G + momentum * (B - G)  if nesterov else B          (``G.lerp(B, momentum)``)
    O <- NS(U)                                                quintic Newton-Schulz, in bf16, ~ U V^T of U's SVD
    W <- W * (1 - lr * weight_decay) - lr * scale(m, n) * O   decoupled weight decay, then the update

``scale`` is ``sqrt(max(1, m / n))`` (``adjust_lr: original``, torch.optim.Muon's default) or
``0.2 * sqrt(max(m, n))`` (``match_rms_adamw``: the update's RMS matches AdamW's, so AdamW's learning rate and
weight decay can be reused). A parameter of shape ``[..., m, n]`` (the grouped experts' ``[num_experts, m, n]``)
is a batch of ``m x n`` matrices, orthogonalized one by one in one batched iteration. On one process the update
of a 2-D parameter is torch.optim.Muon's (same operations, same order).

The groups of one optimizer carry ``use_muon``; groups without it are stepped by torch's fused AdamW kernel
(decoupled weight decay; the state of torch.optim.AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``), so the
optimizer is a single ``torch.optim.Optimizer`` with one learning-rate schedule, and its ``state_dict`` is the
ordinary one (Lightning checkpoints; DCP's ``get_optimizer_state_dict`` under FSDP).

Sharded parameters (``DTensor``): the elementwise work (momentum, weight decay, the update) runs on the local
shard. Newton-Schulz needs each matrix whole: when a placement splits one of the last two dimensions (FSDP2's
``Shard(0)`` of a 2-D weight), the momentum-updated matrix is all-gathered over that mesh dimension in bf16 (one
all-gather per matrix and step, of the full matrix's size), every rank orthogonalizes the whole matrix and keeps
its own rows. A placement on a leading dimension splits whole matrices (experts over ``ep``, or over ``edp`` by
FSDP), so grouped expert weights are orthogonalized where they are, without communication.

A step whose gradients are ``None`` leaves the parameter and its state untouched (the found-inf skip of
:func:`xtl.train.step.optimizer_step_unless_nonfinite` steps with every gradient set to ``None``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.optim.adam as torch_adam
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

AdjustLR = Literal["original", "match_rms_adamw"]
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``use_muon: True``, AdamW (fused) on the others.

    Every setting is a group default; a group overrides any of them (``lr``, ``weight_decay``, ``use_muon``, ...).

    Args:
        params: Parameters or groups. A Muon group's parameters have at least 2 dimensions.
        lr: Learning rate (Muon's before ``adjust_lr``; AdamW's as is).
        weight_decay: Decoupled weight decay: each step multiplies the parameter by ``1 - lr * weight_decay``.
        use_muon: Whether a group without the key is a Muon group.
        momentum: Muon's momentum.
        nesterov: Nesterov momentum for Muon.
        ns_coefficients: ``(a, b, c)`` of the quintic Newton-Schulz iteration ``X <- a X + (b A + c A^2) X`` with
            ``A = X X^T``.
        ns_steps: Newton-Schulz iterations (< 100).
        eps: Lower bound of the norm the matrix is divided by before the iteration.
        adjust_lr: Scale of Muon's update by the matrix shape ``m x n``: ``original`` ``sqrt(max(1, m / n))``,
            ``match_rms_adamw`` ``0.2 * sqrt(max(m, n))``.
        adamw_betas: AdamW's coefficients of the running averages of the gradient and its square.
        adamw_eps: AdamW's denominator term.

    Raises:
        ValueError: A setting out of range, or a Muon group holding a parameter with fewer than 2 dimensions.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        weight_decay: float = 0.1,
        use_muon: bool = True,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_steps: int = NS_STEPS,
        eps: float = NS_EPS,
        adjust_lr: AdjustLR = "original",
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
    ) -> None:
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            use_muon=use_muon,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            ns_steps=ns_steps,
            eps=eps,
            adjust_lr=adjust_lr,
            adamw_betas=tuple(adamw_betas),
            adamw_eps=adamw_eps,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_group(group)
            # torch's load_state_dict moves a fused AdamW's ``step`` to the parameter's device by this key
            group["fused"] = not group["use_muon"]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient.

        Collective under sharding: every rank of a parameter's mesh must step (a Muon matrix split over ranks is
        gathered).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, momentum = group["lr"], group["momentum"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            grad, buf, weight = _local(param.grad), _local(state["momentum_buffer"]), _local(param)
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            update = _orthogonalized(update, param, group["ns_coefficients"], group["ns_steps"], group["eps"])
            weight.mul_(1 - lr * group["weight_decay"])
            weight.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr"], param.shape))

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:  # as torch.optim.AdamW(fused=True)
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["adamw_betas"]
        torch_adam.adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            fused=True,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["adamw_eps"],
            maximize=False,
        )


def orthogonalize(
    matrix: Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = NS_EPS,
) -> Tensor:
    """The quintic Newton-Schulz iteration on ``matrix`` (``[..., m, n]``: a batch of matrices), in bf16.

    Each matrix is divided by its Frobenius norm (at least ``eps``), then ``X <- a X + (b A + c A^2) X`` with
    ``A = X X^T`` runs ``steps`` times on the wide orientation (``m <= n``). The result has the singular vectors
    of the input and singular values near 1 (roughly 0.5..1.5 with the default coefficients, which trade exactness
    for fewer steps).
    """
    a, b, c = coefficients
    x = matrix.bfloat16()
    if x.ndim > 3:
        x = x.flatten(0, -3)
    tall = matrix.size(-2) > matrix.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:  # torch.optim.Muon's exact operations
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if tall:
        x = x.mT
    return x.reshape(matrix.shape)


def adjusted_lr(lr: float, adjust_lr: AdjustLR, shape: torch.Size | tuple[int, ...]) -> float:
    """Muon's learning rate for a matrix of ``shape`` (``[..., m, n]``): ``lr * sqrt(max(1, m / n))``
    (``original``) or ``lr * 0.2 * sqrt(max(m, n))`` (``match_rms_adamw``)."""
    m, n = shape[-2], shape[-1]
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(m, n))
    return lr * math.sqrt(max(1, m / n))


def _check_group(group: dict[str, Any]) -> None:
    if not group["lr"] >= 0 or not group["weight_decay"] >= 0:
        raise ValueError(f"Muon: lr and weight_decay must be >= 0, got {group['lr']} and {group['weight_decay']}")
    if not 0 <= group["momentum"] < 1:
        raise ValueError(f"Muon: momentum must be in [0, 1), got {group['momentum']}")
    if len(group["ns_coefficients"]) != 3 or not 0 < group["ns_steps"] < 100:
        raise ValueError("Muon: ns_coefficients takes 3 numbers and ns_steps is in 1..99")
    if group["adjust_lr"] not in ("original", "match_rms_adamw"):
        raise ValueError(f"Muon: adjust_lr is original or match_rms_adamw, got {group['adjust_lr']!r}")
    if group["use_muon"]:
        for param in group["params"]:
            if param.ndim < 2:
                raise ValueError(f"Muon: a Muon group holds a parameter of shape {tuple(param.shape)}; use AdamW")


def _local(tensor: Tensor) -> Tensor:
    """The local shard of a ``DTensor`` (a view: in-place operations change the ``DTensor``), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _orthogonalized(update: Tensor, param: Tensor, coefficients: tuple, steps: int, eps: float) -> Tensor:
    """:func:`orthogonalize` of whole matrices, for ``update``, this rank's shard of ``param``'s update."""
    if not isinstance(param, DTensor):
        return orthogonalize(update, coefficients, steps, eps)
    mesh, placements = param.device_mesh, tuple(param.placements)
    matrix_dims = (param.ndim - 2, param.ndim - 1)
    whole = tuple(
        Replicate() if p.is_shard() and p.dim % param.ndim in matrix_dims else p  # type: ignore[attr-defined]
        for p in placements
    )
    if whole == placements:  # only leading (batch) dimensions are split: every local matrix is whole
        return orthogonalize(update, coefficients, steps, eps) if update.numel() else update.bfloat16()
    # gathered in bf16: the iteration starts by rounding to bf16, so the result is the same at half the bytes
    shard = DTensor.from_local(update.bfloat16(), mesh, placements, shape=param.shape, stride=param.stride())
    full = orthogonalize(shard.redistribute(mesh, whole).to_local(), coefficients, steps, eps)
    # Replicate -> Shard keeps this rank's part without communication
    whole_dt = DTensor.from_local(full, mesh, whole, shape=param.shape, stride=full.stride())
    return whole_dt.redistribute(mesh, placements).to_local()
