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
        # optimizer:                                          # Muon on hidden matrices, AdamW on the rest
        #   class_path: xtl.train.MuonConfig
        #   init_args: {lr: 3.0e-3, adjust_lr: match_rms_adamw}
        schedule: {kind: cosine, warmup_steps: 30, min_lr_ratio: 0.05}
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from xtl.errors import ConfigError, did_you_mean
from xtl.model import BaseModel
from xtl.module.experts import GroupedExperts
from xtl.module.norm import NORM_TYPES
from xtl.train.muon import NS_COEFFICIENTS, NS_EPS, NS_STEPS, AdjustLR, Muon

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
class MuonConfig(OptimizerConfig):
    """Muon on the hidden weight matrices, AdamW on every other parameter: one :class:`xtl.train.muon.Muon`.

    Muon orthogonalizes each matrix's Nesterov momentum with a Newton-Schulz iteration (grouped expert weights
    ``[num_experts, m, n]``: each expert's matrix), one HF matrix at a time: a fused q/k/v or gate/up projection
    (``fused_projections``) and an expert's gate and up rows (where the checkpoint keeps them apart) are
    orthogonalized part by part, as the unfused model's matrices. Hidden matrices are the weights of ``nn.Linear``
    layers (attention and MLP projections, shared experts, MLA's low-rank projections, the vision tower's and
    merger's linear layers) and the grouped expert weights; the embeddings, the LM head, norms, biases, routers and
    the vision patch embedding (a convolution) go to AdamW. ``muon_params`` / ``adamw_params`` move parameters by
    name.

    The groups of :meth:`OptimizerConfig.param_groups` (weight decay, ``lr_scales`` by model part) are kept and each
    is split into its Muon and AdamW parameters. Under FSDP every rank gathers each hidden matrix's update once per
    step (see :mod:`xtl.train.muon`).

    Attributes:
        momentum: Muon's momentum.
        nesterov: Nesterov momentum.
        ns_coefficients: ``(a, b, c)`` of the quintic Newton-Schulz iteration.
        ns_steps: Newton-Schulz iterations.
        eps: Lower bound of the norm a matrix is divided by before the iteration.
        adjust_lr: ``original`` (torch.optim.Muon's default): the update is scaled by ``sqrt(max(1, m / n))`` for an
            ``m x n`` matrix, and ``lr`` is Muon's own (~0.02); ``match_rms_adamw``: scaled by
            ``0.2 * sqrt(max(m, n))``, the RMS of AdamW's update, so ``lr`` and ``weight_decay`` tuned for AdamW apply.
        adamw_lr: Learning rate of the AdamW parameters (times their part's ``lr_scales``); ``None``: ``lr``, right
            with ``match_rms_adamw``. With ``original`` set it to the AdamW learning rate.
        adamw_betas: AdamW's coefficients of the running averages of the gradient and its square.
        adamw_eps: AdamW's denominator term.
        muon_params: Regular expressions (``re.search`` on the parameter name, e.g. ``lm_head``); a trainable
            parameter of 2 or more dimensions that one matches goes to Muon.
        adamw_params: Regular expressions; a trainable parameter that one matches goes to AdamW.

    Raises:
        ConfigError: A setting out of range, a pattern that does not compile, matches no trainable parameter,
            names a parameter with fewer than 2 dimensions (``muon_params``) or names one the other list names too.
    """

    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    ns_steps: int = NS_STEPS
    eps: float = NS_EPS
    adjust_lr: AdjustLR = "original"
    adamw_lr: float | None = None
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    muon_params: list[str] = field(default_factory=list)
    adamw_params: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.adjust_lr not in ("original", "match_rms_adamw"):
            raise ConfigError(f"optimizer.adjust_lr: {self.adjust_lr!r} is not original or match_rms_adamw")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optimizer.momentum must be in [0, 1), got {self.momentum}")
        if len(self.ns_coefficients) != 3:
            raise ConfigError(f"optimizer.ns_coefficients takes 3 numbers (a, b, c), got {self.ns_coefficients}")
        if not 0 < self.ns_steps < 100:
            raise ConfigError(f"optimizer.ns_steps must be in 1..99, got {self.ns_steps}")
        if self.adamw_lr is not None and not self.adamw_lr >= 0:
            raise ConfigError(f"optimizer.adamw_lr must be >= 0, got {self.adamw_lr}")
        for key in ("muon_params", "adamw_params"):
            for pattern in getattr(self, key):
                try:
                    re.compile(pattern)
                except re.error as err:
                    raise ConfigError(f"optimizer.{key}: {pattern!r} is not a regular expression ({err})") from None

    def param_groups(self, model: nn.Module) -> list[dict]:
        """:meth:`OptimizerConfig.param_groups`, each split into a Muon group (``use_muon: True``) and an AdamW
        group (``use_muon: False``, learning rate ``adamw_lr`` x the part's scale) by :meth:`uses_muon`."""
        muon = self.uses_muon(model)
        by_id = {id(param): name for name, param in model.named_parameters()}
        adamw_lr = self.lr if self.adamw_lr is None else self.adamw_lr
        groups = []
        for group in super().param_groups(model):
            scale = self.lr_scales.get(group["name"], 1.0)
            for use_muon in (True, False):
                params = [p for p in group["params"] if muon[by_id[id(p)]] == use_muon]
                if params:
                    lr = group["lr"] if use_muon else adamw_lr * scale
                    groups.append({**group, "params": params, "lr": lr, "use_muon": use_muon})
        return groups

    def uses_muon(self, model: nn.Module) -> dict[str, bool]:
        """``parameter name -> whether Muon updates it``, for every trainable parameter of ``model``.

        Raises:
            ConfigError: A pattern of ``muon_params`` / ``adamw_params`` cannot be applied (see the class).
        """
        trainable = {name: param for name, param in model.named_parameters() if param.requires_grad}
        hidden = _hidden_matrices(model)
        forced: dict[str, dict[str, str]] = {}
        for key in ("muon_params", "adamw_params"):
            for pattern in getattr(self, key):
                names = [name for name in trainable if re.search(pattern, name)]
                if not names:
                    raise ConfigError(
                        f"optimizer.{key}: {pattern!r} matches no trainable parameter of {type(model).__name__} "
                        f"(names look like {next(iter(trainable), '-')!r})"
                    )
                forced[key] = {**forced.get(key, {}), **dict.fromkeys(names, pattern)}
        muon, adamw = forced.get("muon_params", {}), forced.get("adamw_params", {})
        if both := sorted(muon.keys() & adamw.keys()):
            raise ConfigError(
                f"optimizer.muon_params ({muon[both[0]]!r}) and optimizer.adamw_params ({adamw[both[0]]!r}) both "
                f"name {both[0]}; make the patterns exclusive"
            )
        for name, pattern in muon.items():
            if trainable[name].ndim < 2:
                raise ConfigError(
                    f"optimizer.muon_params: {pattern!r} names {name} of shape {tuple(trainable[name].shape)}; Muon "
                    "orthogonalizes matrices (2 or more dimensions), narrow the pattern"
                )
        return {name: name in muon or (name not in adamw and id(p) in hidden) for name, p in trainable.items()}

    def build(self, model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
        """:meth:`create` over :meth:`param_groups`, each Muon parameter's matrices split into the HF matrices they
        stack (:meth:`matrix_rows`)."""
        return self.create(self.param_groups(model), device, self.matrix_rows(model))

    def matrix_rows(self, model: nn.Module) -> dict[torch.Tensor, tuple[int, ...]]:
        """The Muon parameters of ``model`` whose matrices stack several HF matrices (a fused q/k/v or gate/up
        projection; an expert's gate and up rows where the checkpoint keeps them apart), with the rows of each
        (``BaseModel.hf_matrix_rows``): Muon orthogonalizes each on its own, as it would the unfused model's."""
        if not isinstance(model, BaseModel):
            return {}
        muon = self.uses_muon(model)
        split = {}
        for name, param in model.named_parameters():
            if muon.get(name):
                rows = model.hf_matrix_rows(name, param.shape[-2])
                if len(rows) > 1:
                    split[param] = rows
        return split

    def create(
        self,
        groups: list[dict],
        device: torch.device,
        matrix_rows: dict[torch.Tensor, tuple[int, ...]] | None = None,
    ) -> torch.optim.Optimizer:
        """:class:`~xtl.train.muon.Muon` over ``groups`` (each group has ``use_muon``); ``matrix_rows``: the
        parameters that stack several matrices (see :meth:`matrix_rows`)."""
        return Muon(
            groups,
            lr=self.lr,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            nesterov=self.nesterov,
            ns_coefficients=tuple(self.ns_coefficients),
            ns_steps=self.ns_steps,
            eps=self.eps,
            adjust_lr=self.adjust_lr,
            adamw_betas=tuple(self.adamw_betas),
            adamw_eps=self.adamw_eps,
            matrix_rows=matrix_rows,
        )


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

    Norm weights (the modules of :data:`~xtl.module.norm.NORM_TYPES`), biases and embeddings get no weight decay
    when ``no_decay_norm_bias_embed`` is set.
    """
    no_decay_ids = set()
    if no_decay_norm_bias_embed:
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, (nn.Embedding, *NORM_TYPES)) or name.endswith("bias"):
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


def _hidden_matrices(model: nn.Module) -> set[int]:
    """``id``s of the hidden weight matrices: 2-D weights of ``nn.Linear`` layers other than the LM head (an xtl
    model's ``text_model().lm_head``), and the grouped experts' 3-D weights. A parameter that another module shares
    (a tied head is the embedding) counts only when every module holding it qualifies."""
    head = model.text_model().lm_head if isinstance(model, BaseModel) else None
    verdicts: dict[int, bool] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            linear = isinstance(module, nn.Linear) and name == "weight" and param.ndim == 2 and module is not head
            experts = isinstance(module, GroupedExperts) and param.ndim == 3
            verdicts[id(param)] = verdicts.get(id(param), True) and (linear or experts)
    return {key for key, hidden in verdicts.items() if hidden}
