"""One optimizer step's forward/backward over micro-batches, normalized by the global supervised-token count."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.distributed.tensor import DTensor

from xtl.batch import ModelOutput


@dataclass
class StepResult:
    """What one step's forward/backward produced (local to this rank unless stated).

    Attributes:
        loss_sum: Sum of token losses on this rank (detached, fp32).
        global_tokens: Supervised tokens of the step over all data-parallel ranks.
        outputs: The micro-batch outputs' extras (router statistics, ...), in order.
    """

    loss_sum: torch.Tensor
    global_tokens: torch.Tensor
    outputs: list[dict[str, torch.Tensor]]


def global_token_count(local: int, device: torch.device, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's supervised-token count summed over ``group``, the layout's data group (``None``: one rank, the
    count itself; never the process's default group, which other runs may share)."""
    count = torch.tensor(float(local), device=device)
    if group is not None:
        dist.all_reduce(count, group=group)
    return count


def forward_backward(
    forward: Callable[[object], ModelOutput],
    micro_batches: Sequence[object],
    num_tokens: Callable[[object], int],
    dp_world_size: int,
    backward: Callable[[torch.Tensor], None],
    device: torch.device,
    group: dist.ProcessGroup | None,
    extra_loss: Callable[[ModelOutput, torch.Tensor], torch.Tensor | None] | None = None,
    gradient_sync: Callable[[bool], None] | None = None,
) -> StepResult:
    """Run forward/backward on every micro-batch with the loss ``loss_sum / global_tokens * dp_world_size``.

    Data-parallel gradient reduction averages over ``dp_world_size`` ranks, so the reduced gradient is the gradient
    of ``sum(all token losses) / global_tokens``: independent of how tokens are split into ranks and micro-batches.

    Args:
        forward: Runs the model on one micro-batch, returning a ``ModelOutput`` with ``loss_sum``.
        micro_batches: This rank's micro-batches of the step.
        num_tokens: Supervised tokens of one micro-batch.
        dp_world_size: Ranks the gradient reduction averages over.
        backward: Backpropagates a scalar (``LightningModule.manual_backward`` or ``Tensor.backward``).
        device: Device of the token count.
        group: The layout's data group the token count sums over (``None``: one rank).
        extra_loss: Optional extra objective per micro-batch (e.g. router losses), given the output and the global
            token count; added before backward.
        gradient_sync: Called with False before all but the last micro-batch and True before the last, so sharded
            gradients are reduced once per step.
    """
    global_tokens = global_token_count(sum(num_tokens(mb) for mb in micro_batches), device, group)
    denominator = global_tokens.clamp(min=1.0)
    loss_sum = torch.zeros((), device=device)
    extras = []
    for i, mb in enumerate(micro_batches):
        if gradient_sync is not None:
            gradient_sync(i == len(micro_batches) - 1)
        out = forward(mb)
        loss = out.loss_sum / denominator * dp_world_size
        extra = extra_loss(out, denominator) if extra_loss is not None else None
        if extra is not None:
            loss = loss + extra
        backward(loss)
        loss_sum += out.loss_sum.detach().float()
        extras.append({k: v.detach() if torch.is_tensor(v) else v for k, v in out.extras.items()})
    return StepResult(loss_sum, global_tokens, extras)


def grad_norm_and_clip(params: Sequence[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Total gradient 2-norm over all parameters; clips in place when ``max_norm`` is set.

    DTensor-aware: gradients are grouped by device mesh (dense parameters on the data-parallel mesh, experts on the
    expert-parallel mesh), each group's norm is reduced over its mesh, and the total is the norm of the group norms.
    """
    groups: dict[object, list[nn.Parameter]] = {}
    for param in params:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(mesh, []).append(param)
    if not groups:
        return torch.zeros(())
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if max_norm is not None:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total.detach()


def optimizer_step_unless_nonfinite(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
    """Step ``optimizer`` unless ``grad_norm`` is not finite; returns the found-inf flag (1.0: skipped).

    Optimizers with a fused found-inf path (``_step_supports_amp_scaling``: fused AdamW/Adam/SGD) get the flag as
    ``GradScaler`` hands it over and skip on the device: weights, moments and the step count stay untouched and
    nothing is read back on the host. Other optimizers read the flag on the host (one sync) and, on a non-finite
    step, step with every gradient set to ``None`` (torch optimizers skip parameters without a gradient). In both
    cases ``optimizer.step()`` is called once, so Lightning counts the step.

    Args:
        optimizer: The optimizer (a Lightning ``LightningOptimizer`` wrapper or a torch optimizer).
        grad_norm: The step's total gradient norm (a device tensor).
    """
    found_inf = (~torch.isfinite(grad_norm)).float()
    inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    if getattr(inner, "_step_supports_amp_scaling", False):
        inner.grad_scale = None
        inner.found_inf = found_inf.to(_param_device(inner))
    elif bool(found_inf):
        optimizer.zero_grad(set_to_none=True)
    optimizer.step()
    return found_inf


def _param_device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")


def is_logged_step(trainer: Any) -> bool:
    """Whether the loggers write this training step (Lightning's ``log_every_n_steps`` rule): the only steps on
    which logged values are read back on the host."""
    return bool(trainer._logger_connector.should_update_logs)


class StepWindow:
    """Wall time and tokens since the last logged step, for rates that are honest on asynchronous devices.

    A step's host-side duration is not its device time on a GPU (kernels are still queued), so rates are taken over
    the window between two logged steps, after waiting for the device once per window (the logged values are read
    then anyway).
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.tokens = 0
        self.steps = 0

    def add(self, tokens: int | torch.Tensor) -> None:
        """Count one step's tokens (a host int or a device tensor; nothing is read back here)."""
        self.tokens = self.tokens + tokens
        self.steps += 1

    def close(self, device: torch.device) -> tuple[float, float, int]:
        """Wait for ``device``, return ``(tokens, seconds, steps)`` of the window and start the next one."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        window = (float(self.tokens), max(now - self.start, 1e-9), self.steps)
        self.start, self.tokens, self.steps = now, 0, 0
        return window
