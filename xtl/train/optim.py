"""Optimizers and learning-rate schedules as typed configs.

``LanguageModule(optimizer=..., schedule=...)`` takes an :class:`OptimizerConfig` and a :class:`ScheduleConfig`.
An optimizer is a subclass of :class:`OptimizerConfig` that implements :meth:`OptimizerConfig.create`; in YAML it
is picked by ``class_path`` (``AdamWConfig`` is the default, so its fields may be given directly)::

    model:
      init_args:
        optimizer: {lr: 3.0e-3, weight_decay: 0.01}          # AdamW (default)
        # optimizer: {class_path: my_pkg.LionConfig, init_args: {lr: 1.0e-4}}
        schedule: {kind: cosine, warmup_steps: 30, min_lr_ratio: 0.05}
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

ScheduleKind = Literal["cosine", "linear", "constant"]


@dataclass
class OptimizerConfig(ABC):
    """What every optimizer takes: the peak learning rate and how weight decay is applied.

    Attributes:
        lr: Peak learning rate (the schedule multiplies it).
        weight_decay: Decoupled weight decay of the decayed parameter group.
        no_decay_norm_bias_embed: No weight decay on norms, biases and embeddings.
    """

    lr: float = 1e-4
    weight_decay: float = 0.1
    no_decay_norm_bias_embed: bool = True

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # Lightning stores the module's hyperparameters (this config included) in checkpoints, which torch loads
        # with weights_only=True: every optimizer config class is declared safe to unpickle.
        torch.serialization.add_safe_globals([cls])

    def build(self, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s trainable parameters, in weight-decay groups."""
        return self.create(param_groups(model, self.weight_decay, self.no_decay_norm_bias_embed), device)

    @abstractmethod
    def create(self, groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
        """Instantiate the torch optimizer over parameter ``groups`` (each has ``params`` and ``weight_decay``)."""


@dataclass
class AdamWConfig(OptimizerConfig):
    """AdamW, fused (one kernel per device and dtype, on CPU and CUDA).

    The fused kernel also takes a found-inf flag, so a step with a non-finite gradient norm is skipped on the device
    without reading the norm back on the host (:func:`xtl.train.step.optimizer_step_unless_nonfinite`).

    Attributes:
        betas: Coefficients of the running averages of the gradient and its square.
        eps: Denominator term.
    """

    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8

    def create(self, groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
        """``torch.optim.AdamW`` over ``groups``."""
        return torch.optim.AdamW(groups, lr=self.lr, betas=tuple(self.betas), eps=self.eps, fused=True)


@dataclass
class ScheduleConfig:
    """Per-step learning-rate multiplier: linear warmup, then decay or constant.

    Attributes:
        kind: ``cosine`` or ``linear`` decay to ``min_lr_ratio``, or ``constant``.
        warmup_steps: Linear warmup steps (from ``1 / warmup_steps`` to 1).
        min_lr_ratio: Final learning rate as a fraction of the peak (cosine/linear).
        decay_steps: Length of the schedule (default: ``trainer.max_steps``); set it to keep the schedule fixed while
            training in several shorter runs.
    """

    kind: ScheduleKind = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    decay_steps: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("cosine", "linear", "constant"):
            raise ValueError(f"schedule.kind: unknown schedule {self.kind!r}; use cosine, linear or constant")

    def lr_lambda(self, total_steps: int) -> Callable[[int], float]:
        """The multiplier as a function of the step, for a schedule of ``total_steps`` steps."""
        return lr_lambda(self.kind, self.warmup_steps, total_steps, self.min_lr_ratio)


torch.serialization.add_safe_globals([ScheduleConfig])


def param_groups(model: nn.Module, weight_decay: float, no_decay_norm_bias_embed: bool = True) -> list[dict]:
    """Split trainable parameters into a decayed group and (optionally) an undecayed one.

    Norm weights, biases and embeddings get no weight decay when ``no_decay_norm_bias_embed`` is set.
    """
    no_decay_ids = set()
    if no_decay_norm_bias_embed:
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if (
                    isinstance(module, nn.Embedding)
                    or "norm" in type(module).__name__.lower()
                    or name.endswith("bias")
                ):
                    no_decay_ids.add(id(param))
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if id(param) in no_decay_ids else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def lr_lambda(kind: ScheduleKind, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Multiplier of the base learning rate at a step: linear warmup, then cosine/linear decay or constant."""
    if kind not in ("cosine", "linear", "constant"):
        raise ValueError(f"unknown schedule {kind!r}; use cosine, linear or constant")

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor
