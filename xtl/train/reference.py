"""The reference policy an objective compares its policy with (DPO family, KTO, the KL term of GRPO).

:class:`ReferenceConfig` is the ``reference`` setting of an objective; :class:`ReferencePolicy` is what it builds and
every objective uses alike:

- ``live``: the starting policy, frozen. When a model transform trains parts of its own (LoRA's adapters) the
  reference is the policy itself under that transform's starting view (:class:`ReferenceViews`: the adapters as they
  were loaded, or off when they started fresh), with no second copy of the model. Otherwise it is a frozen copy
  built by the same ``parallelize`` sequence as the policy (sharded like it, with the same model transforms) from the
  same weights.
- ``adapters_off``: the policy without the parts its transforms train (LoRA: adapters off). Only when that is the
  starting policy (the adapters start fresh); a run that continues from a trained adapter is refused, naming
  ``live``.
- ``precomputed``: a table of the starting policy's log-probabilities, computed once before training and cached with
  the data (:mod:`xtl.train.reference_cache`); objectives that sample online (RL) cannot use it.
- ``model``: a separate model (an HF directory, an alias or a config mapping, with an optional PEFT adapter merged
  into it), built and sharded like the policy.
- ``none``: no reference (reference-free objectives).
- ``auto``: ``none`` when the objective needs no reference, ``adapters_off`` when that is the starting policy, else
  ``live``.

With ``sync_every`` the frozen copy (``live`` without adapters, or ``model``) moves towards the policy every
``sync_every`` optimizer steps, ``reference <- mixup_alpha * policy + (1 - mixup_alpha) * reference`` (TR-DPO, TRL's
``sync_ref_model``); it is then training state and kept in checkpoints. Without it the reference is rebuilt from its
source on resume and left out of checkpoints.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from xtl.errors import ConfigError
from xtl.model import BaseModel, TransformerConfig
from xtl.strategies.parallelize import (
    ModelTransform,
    ParallelizingStrategy,
    ReferenceViews,
    TransformStage,
    WeightSource,
)
from xtl.train.model_spec import resolve_model_config

ReferenceMode = Literal["auto", "live", "adapters_off", "precomputed", "model", "none"]
REFERENCE_MODES: tuple[str, ...] = get_args(ReferenceMode)
KEY = "model.init_args.reference"


@dataclass
class ReferenceConfig:
    """Where an objective's reference log-probabilities come from (``model.init_args.reference``; a bare mode name
    such as ``reference: live`` is short for ``{mode: live}``).

    Args:
        mode: ``auto``, ``live``, ``adapters_off``, ``precomputed``, ``model`` or ``none`` (module docstring).
        model: ``mode: model``: the reference model, as the policy's ``model`` (HF directory, alias or config
            mapping; it must use the policy's tokenizer).
        adapter: ``mode: model``: a PEFT LoRA adapter directory merged into the reference model's weights.
        model_overrides: ``mode: model``: config fields of the reference model to replace.
        sync_every: TR-DPO: every this many optimizer steps the reference moves towards the policy (``None``: never).
        mixup_alpha: The policy's weight in each sync (TRL's ``ref_model_mixup_alpha``).

    Raises:
        ConfigError: An unknown mode, settings of ``mode: model`` without it, or sync settings out of range.
    """

    mode: ReferenceMode = "auto"
    model: str | dict[str, Any] | None = None
    adapter: str | None = None
    model_overrides: dict[str, Any] | None = None
    sync_every: int | None = None
    mixup_alpha: float = 0.6

    def __post_init__(self) -> None:
        if self.mode not in REFERENCE_MODES:
            raise ConfigError(f"{KEY}.mode: {self.mode!r} is not one of {', '.join(REFERENCE_MODES)}")
        if (self.mode == "model") != (self.model is not None):
            raise ConfigError(
                f"{KEY}: mode: model names the reference in model: (an HF directory, alias or config); set both or "
                "neither"
            )
        for name in ("adapter", "model_overrides"):
            if getattr(self, name) is not None and self.mode != "model":
                raise ConfigError(f"{KEY}.{name} applies to mode: model; remove it or set mode: model")
        if self.sync_every is not None:
            if self.sync_every < 1:
                raise ConfigError(f"{KEY}.sync_every must be >= 1 (or null: never), got {self.sync_every}")
            if self.mode in ("adapters_off", "precomputed", "none"):
                raise ConfigError(
                    f"{KEY}.sync_every moves a frozen copy of the policy; mode: {self.mode} has none: use mode live "
                    "or model, or remove sync_every"
                )
        if not 0.0 < self.mixup_alpha <= 1.0:
            raise ConfigError(f"{KEY}.mixup_alpha must be in (0, 1], got {self.mixup_alpha}")


torch.serialization.add_safe_globals([ReferenceConfig])  # a hyperparameter in checkpoints (weights_only loads)


def reference_config(value: str | ReferenceConfig | dict[str, Any]) -> ReferenceConfig:
    """A :class:`ReferenceConfig` from the ``reference`` setting (a mode name, a mapping, or the config)."""
    if isinstance(value, ReferenceConfig):
        return value
    if isinstance(value, dict):
        return ReferenceConfig(**value)
    return ReferenceConfig(mode=value)


class ReferenceOwner(Protocol):
    """What a reference policy needs of its objective (``xtl.train.ReferenceOwner`` has all of it)."""

    model: BaseModel
    model_config: TransformerConfig
    hparams: Any
    device: torch.device

    @property
    def model_transforms(self) -> list[ModelTransform]:
        """The run's model transforms."""

    @property
    def parallelizer(self) -> ParallelizingStrategy:
        """The strategy's ``parallelize`` sequence."""

    def build_frozen_copy(self, transforms: list[ModelTransform]) -> BaseModel:
        """A frozen copy of the starting policy, built with ``transforms``."""


class ReferencePolicy(nn.Module):
    """The reference an objective compares with: a frozen copy, a view of the policy, or nothing
    (:mod:`xtl.train.reference`).

    It is a submodule of the objective so that a synced copy lands in checkpoints; it computes in eval mode whatever
    the objective's mode (its dropout never acts), and none of its parameters trains.

    Args:
        config: The ``reference`` setting.
        needs_reference: Whether the objective compares with a reference at all (``none`` is refused otherwise, and
            the other modes without it).
        precomputable: Whether the objective can read a precomputed table (offline data; not RL).

    Raises:
        ConfigError: A mode the objective cannot use.
    """

    def __init__(self, config: ReferenceConfig, needs_reference: bool, precomputable: bool = True) -> None:
        super().__init__()
        self.config = config
        self.needs_reference = needs_reference
        mode = config.mode
        if mode == "none" and needs_reference:
            raise ConfigError(f"{KEY}: none, but the objective compares with a reference; use auto, live or model")
        if mode not in ("auto", "none") and not needs_reference:
            raise ConfigError(f"{KEY}: {mode}, but the objective uses no reference; use auto or none")
        if mode == "precomputed" and not precomputable:
            raise ConfigError(
                f"{KEY}: precomputed reads a table computed before training, but this objective scores samples drawn "
                "while training; use auto, live or model"
            )
        self.frozen: BaseModel | None = None  # the frozen copy or separate model (live without views, model)
        self._views: list[ReferenceViews] = []
        self._mode = "none" if mode == "auto" and not needs_reference else mode
        self._owner: list[ReferenceOwner] = []  # a list: not a submodule

    @property
    def mode(self) -> str:
        """The mode in effect (``auto`` is resolved by :meth:`build`)."""
        return self._mode

    @property
    def active(self) -> bool:
        """Whether the objective has a reference to compare with."""
        return self._mode != "none"

    @property
    def computes_live(self) -> bool:
        """Whether reference log-probabilities are computed while training (``live``, ``adapters_off``, ``model``)."""
        return self._mode in ("live", "adapters_off", "model")

    @property
    def synced(self) -> bool:
        """Whether the reference moves towards the policy (and so is training state)."""
        return self.config.sync_every is not None

    def build(self, owner: ReferenceOwner) -> None:
        """Resolve ``auto`` and build what the mode needs, once the policy is built (``owner.configure_model``).

        Raises:
            ConfigError: ``adapters_off`` without a transform that offers the starting policy that way; a synced
                reference that is a view of the policy (LoRA); a separate model the policy's data cannot run on.
        """
        self._owner = [owner]
        transforms = [t for t in owner.model_transforms if t.transform_stage == TransformStage.MODEL]
        self._views = [v for t in transforms if (v := t.reference_views(owner.model)) is not None]
        mode = self.config.mode
        if mode == "auto":
            mode = "none" if not self.needs_reference else "adapters_off" if self._base_is_start() else "live"
        if mode == "adapters_off":
            if not self._views:
                raise ConfigError(
                    f"{KEY}: adapters_off needs LoRA adapters (callbacks/lora.yaml); without them use live"
                )
            why = [v.why_base_is_not_start for v in self._views if not v.base_is_start]
            if why:
                raise ConfigError(
                    f"{KEY}: adapters_off, but {why[0]}; use live (a frozen copy of the starting policy)"
                )
        if self.synced and (mode == "adapters_off" or (mode == "live" and self._views)):
            raise ConfigError(
                f"{KEY}.sync_every mixes the policy's weights into a frozen copy, but under LoRA the reference is the "
                "policy's own starting adapters (no copy): remove sync_every, or train without LoRA"
            )
        self._mode = mode
        if mode == "live" and not self._views:
            self.frozen = owner.build_frozen_copy(transforms)
        elif mode == "model":
            self.frozen = self._build_model(owner)
        if self.frozen is not None:  # in the objective's mode between forwards (Lightning checks the modes)
            self.frozen.train(self.training)
        if self.synced:
            self._check_sync(owner.model)

    def describe(self) -> str:
        """What computes the reference, for logs."""
        if self._mode == "live":
            if self._views:
                return "; ".join(v.describe_start for v in self._views)
            return "a frozen copy of the starting policy, sharded like it"
        return {
            "adapters_off": "the model with its LoRA adapters off",
            "precomputed": "the starting policy's log-probabilities, computed once and cached with the data",
            "model": f"the separate model {self.config.model}"
            + (f" with the adapter {self.config.adapter}" if self.config.adapter else ""),
            "none": "none needed",
        }[self._mode]

    @contextmanager
    def computing(self, policy: nn.Module) -> Iterator[nn.Module]:
        """The module that computes the reference, within the block: the frozen model, or the policy under the
        transforms' starting (``live``) or base (``adapters_off``) view; in eval mode and without gradient.

        Raises:
            RuntimeError: The mode computes nothing while training (``precomputed``, ``none``).
        """
        if not self.computes_live:
            raise RuntimeError(f"reference {self._mode} computes no log-probabilities while training")
        if self.frozen is not None:
            with torch.no_grad(), _eval_mode(self.frozen):
                yield self.frozen
            return
        views = [v.start if self._mode == "live" else v.base for v in self._views]
        with ExitStack() as stack, torch.no_grad(), _eval_mode(policy):
            for view in views:
                stack.enter_context(view())
            yield policy

    @contextmanager
    def starting_policy(self, policy: nn.Module, moved: bool) -> Iterator[tuple[nn.Module, str]]:
        """The module that computes the starting policy, within the block (a precomputed table's pass): the policy
        itself when it has not ``moved`` yet, else under the transforms' starting views, else a temporary frozen copy
        (released after the block); in eval mode and without gradient. Yields ``(module, what it is)``.
        """
        owner = self._owner[0]
        temporary: BaseModel | None = None
        with ExitStack() as stack, torch.no_grad():
            if not moved:
                module, source = policy, "the policy before its first step"
            elif self._views:
                for view in self._views:
                    stack.enter_context(view.start())
                module, source = policy, "; ".join(v.describe_start for v in self._views)
            else:
                transforms = [t for t in owner.model_transforms if t.transform_stage == TransformStage.MODEL]
                temporary = module = owner.build_frozen_copy(transforms)
                source = "a copy of the starting policy (the resumed policy has moved)"
            stack.enter_context(_eval_mode(module))
            try:
                yield module, source
            finally:
                if temporary is not None:
                    del module, temporary
                    gc.collect()
                    if owner.device.type == "cuda":
                        torch.cuda.empty_cache()

    def after_optimizer_step(self, policy: nn.Module, step: int) -> None:
        """TR-DPO: on every ``sync_every``-th step, ``reference <- alpha * policy + (1 - alpha) * reference`` for every
        parameter the policy trains (the frozen ones are equal in both)."""
        every = self.config.sync_every
        if every is None or self.frozen is None or step % every:
            return
        alpha = self.config.mixup_alpha
        frozen = dict(self.frozen.named_parameters())
        with torch.no_grad():
            for name, param in policy.named_parameters():
                if param.requires_grad:
                    frozen[name].mul_(1.0 - alpha).add_(param.detach(), alpha=alpha)

    def skipped_checkpoint_keys(self, prefix: str) -> set[str]:
        """The keys a checkpoint leaves out: the whole frozen model unless it is synced (it is rebuilt from its
        source on resume)."""
        if self.frozen is None or self.synced:
            return set()
        return {f"{prefix}frozen.{name}" for name in self.frozen.state_dict()}

    # ---- private ---------------------------------------------------------------------------------------------

    def _base_is_start(self) -> bool:
        return bool(self._views) and all(v.base_is_start for v in self._views)

    def _build_model(self, owner: ReferenceOwner) -> BaseModel:
        config, hf_dir = resolve_model_config(self.config.model, self.config.model_overrides)
        policy = owner.model_config
        if config.vision_language != policy.vision_language:
            kinds = {True: "vision-language", False: "text"}
            raise ConfigError(
                f"{KEY}.model is a {kinds[bool(config.vision_language)]} model and the policy a "
                f"{kinds[bool(policy.vision_language)]} one; the reference must read the same inputs"
            )
        if config.vocab_size < policy.vocab_size:
            raise ConfigError(
                f"{KEY}.model has vocab_size {config.vocab_size}, smaller than the policy's {policy.vocab_size}; the "
                "reference must use the policy's tokenizer"
            )
        adapter = Path(self.config.adapter) if self.config.adapter else None
        with torch.device("meta"):
            model = config.build()
        weights = WeightSource(hf_dir, owner.hparams.seed, getattr(torch, owner.hparams.param_dtype), adapter)
        model = owner.parallelizer.parallelize(model, [], weights)
        model.requires_grad_(False)
        rank_zero_info(f"xtl reference: {self.describe()}")
        return model.eval()

    def _check_sync(self, policy: nn.Module) -> None:
        frozen = {name: param.shape for name, param in self.frozen.named_parameters()}
        trained = {name: param.shape for name, param in policy.named_parameters() if param.requires_grad}
        differ = sorted(name for name, shape in trained.items() if frozen.get(name) != shape)
        if differ:
            raise ConfigError(
                f"{KEY}.sync_every mixes the policy into the reference parameter by parameter, but the reference "
                f"model has no parameter {differ[0]!r} of the policy's shape; use a reference of the policy's "
                "architecture, or remove sync_every"
            )


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` (and every submodule) in eval mode within the block, each back in its own mode after."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
