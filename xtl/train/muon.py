"""Muon for hidden weight matrices and AdamW for every other parameter, as one torch optimizer.

Muon (momentum orthogonalized by Newton-Schulz) updates a weight matrix ``W`` (``m x n``) with its gradient ``G``::

    B <- momentum * B + (1 - momentum) * G                   (the momentum buffer; torch's ``lerp``)
    U <- G + momentum * (B - G)  if nesterov else B          (``G.lerp(B, momentum)``)
    O <- NS(U)                                                quintic Newton-Schulz, in bf16, ~ U V^T of U's SVD
    W <- W * (1 - lr * weight_decay) - lr * scale(m, n) * O   decoupled weight decay, then the update

``scale`` is ``sqrt(max(1, m / n))`` (``adjust_lr: original``, torch.optim.Muon's default) or
``0.2 * sqrt(max(m, n))`` (``match_rms_adamw``: the update's RMS matches AdamW's, so AdamW's learning rate and
weight decay can be reused). A parameter of shape ``[..., m, n]`` (the grouped experts' ``[num_experts, m, n]``)
is a batch of ``m x n`` matrices, orthogonalized one by one in one batched iteration. A parameter that stacks
several matrices on its rows (``matrix_rows``: a fused q/k/v or gate/up projection, or an expert's gate and up
rows, which the HF checkpoint keeps apart) is orthogonalized and scaled matrix by matrix, as those matrices would
be on their own. On one process the update of a 2-D parameter is torch.optim.Muon's (same operations, same
order), and so is each stacked matrix's.

The groups of one optimizer carry ``use_muon``; groups without it are stepped by torch's fused AdamW kernel
(decoupled weight decay; the state of torch.optim.AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``), so the
optimizer is a single ``torch.optim.Optimizer`` with one learning-rate schedule, and its ``state_dict`` is the
ordinary one (Lightning checkpoints; DCP's ``get_optimizer_state_dict`` under FSDP).

Sharded parameters (``DTensor``): the elementwise work (momentum, weight decay, the update) runs on the local
shard. Newton-Schulz needs each matrix whole: when a placement splits one of the last two dimensions (FSDP2's
``Shard(0)`` of a 2-D weight), the momentum-updated matrix is all-gathered over that mesh dimension in bf16 (one
all-gather per parameter and step, of the full parameter's size), every rank orthogonalizes the whole matrix (each
stacked matrix on its own) and keeps its own rows. A placement on a leading dimension splits whole matrices
(experts over ``ep``, or over ``edp`` by FSDP), so grouped expert weights are orthogonalized where they are,
without communication.

A step whose gradients are ``None`` leaves the parameter and its state untouched (the found-inf skip of
:func:`xtl.train.step.optimizer_step_unless_nonfinite` steps with every gradient set to ``None``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.optim.adam as torch_adam
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

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
        matrix_rows: Parameters (of Muon groups) whose matrices stack several matrices on their rows, with the
            rows of each (dimension ``-2``, in order; e.g. the q, k and v rows of a fused projection): each stacked
            matrix is orthogonalized and scaled (``adjust_lr``) on its own. Any other parameter's matrices are
            single matrices.

    Raises:
        ValueError: A setting out of range, a Muon group holding a parameter with fewer than 2 dimensions, or
            ``matrix_rows`` naming a parameter outside the Muon groups or rows that do not add up to its own.
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
        matrix_rows: Mapping[Tensor, Sequence[int]] | None = None,
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
        self.matrix_rows: dict[Tensor, tuple[int, ...]] = {p: tuple(rows) for p, rows in (matrix_rows or {}).items()}
        _check_matrix_rows(self.matrix_rows, self.param_groups)

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
            rows = self.matrix_rows.get(param, (param.shape[-2],))
            update = _orthogonalized(update, param, rows, group["ns_coefficients"], group["ns_steps"], group["eps"])
            weight.mul_(1 - lr * group["weight_decay"])
            for start, length, matrix in _local_matrices(param, rows):  # each stacked matrix with its own scale
                alpha = -adjusted_lr(lr, group["adjust_lr"], (matrix, param.shape[-1]))
                weight.narrow(-2, start, length).add_(update.narrow(-2, start, length), alpha=alpha)

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


def _check_matrix_rows(matrix_rows: dict[Tensor, tuple[int, ...]], groups: list[dict[str, Any]]) -> None:
    muon = {id(p) for group in groups if group["use_muon"] for p in group["params"]}
    for param, rows in matrix_rows.items():
        if id(param) not in muon:
            raise ValueError(
                f"Muon: matrix_rows names a parameter of shape {tuple(param.shape)} outside the Muon groups"
            )
        if not rows or min(rows) < 1 or sum(rows) != param.shape[-2]:
            raise ValueError(
                f"Muon: matrix_rows {rows} do not split the {param.shape[-2]} rows of {tuple(param.shape)}"
            )


def _local(tensor: Tensor) -> Tensor:
    """The local shard of a ``DTensor`` (a view: in-place operations change the ``DTensor``), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _orthogonalized(
    update: Tensor, param: Tensor, rows: tuple[int, ...], coefficients: tuple, steps: int, eps: float
) -> Tensor:
    """:func:`orthogonalize` of whole matrices, each of the matrices stacked on the rows (``rows``) on its own, for
    ``update``, this rank's shard of ``param``'s update."""
    if not isinstance(param, DTensor):
        return _orthogonalize_stacked(update, rows, coefficients, steps, eps)
    mesh, placements = param.device_mesh, tuple(param.placements)
    matrix_dims = (param.ndim - 2, param.ndim - 1)
    whole = tuple(
        Replicate() if p.is_shard() and p.dim % param.ndim in matrix_dims else p  # type: ignore[attr-defined]
        for p in placements
    )
    if whole == placements:  # only leading (batch) dimensions are split: every local matrix is whole
        return _orthogonalize_stacked(update, rows, coefficients, steps, eps) if update.numel() else update.bfloat16()
    # gathered in bf16: the iteration starts by rounding to bf16, so the result is the same at half the bytes
    shard = DTensor.from_local(update.bfloat16(), mesh, placements, shape=param.shape, stride=param.stride())
    full = _orthogonalize_stacked(shard.redistribute(mesh, whole).to_local(), rows, coefficients, steps, eps)
    # Replicate -> Shard keeps this rank's part without communication
    whole_dt = DTensor.from_local(full, mesh, whole, shape=param.shape, stride=full.stride())
    return whole_dt.redistribute(mesh, placements).to_local()


def _orthogonalize_stacked(
    matrix: Tensor, rows: tuple[int, ...], coefficients: tuple, steps: int, eps: float
) -> Tensor:
    """:func:`orthogonalize` of each matrix stacked on the rows of ``matrix`` (``rows`` of each), joined again."""
    if len(rows) == 1:
        return orthogonalize(matrix, coefficients, steps, eps)
    return torch.cat([orthogonalize(part, coefficients, steps, eps) for part in matrix.split(rows, dim=-2)], dim=-2)


def _local_matrices(param: Tensor, rows: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """``(first local row, local rows, rows of the matrix)`` of each stacked matrix that this rank's shard of
    ``param`` holds rows of (a sharded 2-D weight holds a run of rows that may cross matrices)."""
    first, count = _local_row_range(param)
    start = 0
    for matrix in rows:
        low, high = max(start, first), min(start + matrix, first + count)
        if low < high:
            yield low - first, high - low, matrix
        start += matrix


def _local_row_range(param: Tensor) -> tuple[int, int]:
    """``(first row, rows)`` of this rank's shard of ``param`` on dimension ``-2`` (all of them unless a placement
    splits that dimension; nested splits in mesh order, as ``DTensor`` places them)."""
    first, count = 0, param.shape[-2]
    if isinstance(param, DTensor):
        mesh, coordinate = param.device_mesh, param.device_mesh.get_coordinate()
        for mesh_dim, placement in enumerate(param.placements):
            if placement.is_shard() and placement.dim % param.ndim == param.ndim - 2:  # type: ignore[attr-defined]
                count, offset = Shard.local_shard_size_and_offset(count, mesh.size(mesh_dim), coordinate[mesh_dim])
                first += offset
    return first, count
