"""Optimizers and learning-rate schedules as typed configs.

``LanguageModule(optimizer=..., schedule=...)`` takes an :class:`OptimizerConfig` and a :class:`ScheduleConfig`.
An optimizer config decides its parameter groups (:meth:`OptimizerConfig.param_groups`: weight decay, and a
learning rate per model part) and creates the torch optimizer over them (:meth:`OptimizerConfig.create`). In YAML
it is picked by ``class_path``; ``AdamWConfig`` is the default, so its fields may be given directly, and
:class:`TorchOptimizer` names any ``torch.optim`` class with its arguments::

    model:
      init_args:
        optimizer: {lr: 3.0e-3, weight_decay: 0.01}          # AdamW (default)
        # optimizer:
        #   class_path: xtl.train.TorchOptimizer
        #   init_args: {name: torch.optim.SGD, lr: 0.1, kwargs: {momentum: 0.9}}
        schedule: {kind: cosine, warmup_steps: 30, min_lr_ratio: 0.05}
"""

from __future__ import annotations

import importlib
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from xtl.errors import ConfigError, did_you_mean
from xtl.model import BaseModel

ScheduleKind = Literal["cosine", "linear", "constant"]


@dataclass
class OptimizerConfig(ABC):
    """What every optimizer takes -- the peak learning rate and the parameter groups -- and how it is created.

    Attributes:
        lr: Peak learning rate (the schedule multiplies it).
        weight_decay: Decoupled weight decay of the decayed parameter group.
        no_decay_norm_bias_embed: No weight decay on norms, biases and embeddings.
        lr_scales: Learning rate of a model part relative to ``lr``, by part name (``vision``, ``merger`` and
            ``language`` for a vision-language model; see ``BaseModel.parameter_parts``); unnamed parts use 1.
    """

    lr: float = 1e-4
    weight_decay: float = 0.1
    no_decay_norm_bias_embed: bool = True
    lr_scales: dict[str, float] = field(default_factory=dict)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # Lightning stores the module's hyperparameters (this config included) in checkpoints, which torch loads
        # with weights_only=True: every optimizer config class is declared safe to unpickle.
        torch.serialization.add_safe_globals([cls])

    def build(self, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s trainable parameters, in the groups of :meth:`param_groups`."""
        return self.create(self.param_groups(model), device)

    def param_groups(self, model: nn.Module) -> list[dict]:
        """The trainable parameters in groups: decayed / undecayed (:func:`param_groups`), each split by model part.

        Each group has ``params``, ``weight_decay``, ``lr`` (``lr`` x the part's scale) and ``name`` (the part).

        Raises:
            ConfigError: ``lr_scales`` names a part the model does not have, or a scale is not > 0.
        """
        parts = model.parameter_parts() if isinstance(model, BaseModel) else {"language": [model]}
        owner = {id(p): part for part, modules in parts.items() for m in modules for p in m.parameters()}
        for part, scale in self.lr_scales.items():
            if part not in parts:
                raise ConfigError(
                    f"optimizer.lr_scales: {type(model).__name__} has no part {part!r}{did_you_mean(part, parts)}; "
                    f"its parts are {', '.join(parts)}"
                )
            if not scale > 0:
                raise ConfigError(f"optimizer.lr_scales.{part} must be > 0, got {scale} (freeze the part instead)")
        groups = []
        for group in param_groups(model, self.weight_decay, self.no_decay_norm_bias_embed):
            for part in parts:
                params = [p for p in group["params"] if owner.get(id(p), "language") == part]
                if params:
                    lr = self.lr * self.lr_scales.get(part, 1.0)
                    groups.append({**group, "params": params, "lr": lr, "name": part})
        return groups

    @abstractmethod
    def create(self, groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
        """Instantiate the torch optimizer over parameter ``groups`` (each has ``params``, ``weight_decay`` and
        ``lr``)."""


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
class TorchOptimizer(OptimizerConfig):
    """Any ``torch.optim`` optimizer -- or an importable subclass of ``torch.optim.Optimizer`` -- with its arguments.

    ``lr`` and ``weight_decay`` are passed as the class's own arguments (and per group), ``kwargs`` as the rest.
    The found-inf skip of a non-finite step stays on the device when the class has a fused path and ``kwargs``
    asks for it (``fused: true``; :func:`xtl.train.step.optimizer_step_unless_nonfinite`).

    Attributes:
        name: The class: a name in ``torch.optim`` (``SGD``) or a class path (``torch.optim.Adam``,
            ``my_pkg.Lion``).
        kwargs: Other constructor arguments (``momentum``, ``betas``, ``fused``, ...), checked against the class.

    Raises:
        ConfigError: ``name`` is not an optimizer class, or ``kwargs`` holds an argument the class does not take.
    """

    name: str = "torch.optim.AdamW"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.optimizer_class()

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The optimizer class ``name`` names (checked, with its ``kwargs``)."""
        module, _, attr = self.name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module or "torch.optim"), attr)
        except (ImportError, AttributeError):
            names = [
                n for n, c in vars(torch.optim).items() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
            ]
            raise ConfigError(
                f"optimizer.name {self.name!r} is not an importable optimizer class{did_you_mean(attr, names)}; "
                f"name a torch.optim class ({', '.join(sorted(names))}) or a class path"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer.name {self.name!r} is not a torch.optim.Optimizer subclass")
        accepted = set(inspect.signature(cls).parameters) - {"params", "self"}
        for key in self.kwargs:
            if key in ("lr", "weight_decay"):
                raise ConfigError(f"optimizer.kwargs.{key}: set optimizer.{key} instead (it also sets the groups)")
            if key not in accepted:
                raise ConfigError(
                    f"optimizer.kwargs.{key}: {cls.__name__} takes no argument {key!r}{did_you_mean(key, accepted)}; "
                    f"it takes {', '.join(sorted(accepted))}"
                )
        if "weight_decay" not in accepted and self.weight_decay:
            raise ConfigError(f"optimizer.weight_decay: {cls.__name__} has no weight decay; set it to 0")
        return cls

    def create(self, groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
        """``name``'s class over ``groups`` with ``lr``, ``weight_decay`` and ``kwargs``."""
        cls = self.optimizer_class()
        decay = "weight_decay" in inspect.signature(cls).parameters
        if not decay:
            groups = [{k: v for k, v in group.items() if k != "weight_decay"} for group in groups]
        return cls(groups, lr=self.lr, **({"weight_decay": self.weight_decay} if decay else {}), **self.kwargs)


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
