"""The scale seam's contract: one ordered ``parallelize`` sequence and the two protocols that plug into it.

A meta-device model becomes a trainable one in exactly this order (``ParallelizingStrategy.parallelize``):

1. model transforms contributed by callbacks (``TransformStage.MODEL``: LoRA, fp8, ...), in callback order;
2. activation checkpointing / offload (``TransformStage.ACTIVATION``);
3. compile (``TransformStage.COMPILE``);
4. context parallelism (``ParallelizingStrategy.apply_context_parallel``: attention through Ulysses over ``cp``);
5. expert parallelism (``ParallelizingStrategy.apply_expert_parallel``: experts split, dispatcher installed);
6. data-parallel sharding (``ParallelizingStrategy.apply_data_parallel``: FSDP2 over the model's shard units);
7. weight load (``from_hf``) or seeded initialization, then the parameter dtype (and a merged adapter, for a frozen
   reference model of its own);
8. each transform's ``after_weights`` (same order as 1-3), e.g. quantizing frozen base weights for QLoRA.

The two protocols are abstract base classes, so taking part is declared by subclassing, never discovered:

- :class:`ModelTransform` -- a callback that transforms the model at its stage.
- :class:`ParallelizingStrategy` -- a strategy that owns the sequence; its hooks say how experts and parameters are
  distributed. :class:`SingleDevice` is the strategy-less default (one process, nothing distributed).

``LanguageModule.configure_model`` only builds the model on ``meta`` and calls ``parallelize``; it knows nothing
of the individual features.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from enum import IntEnum
from pathlib import Path
from typing import Any, ClassVar, cast

import torch

from xtl.model import BaseModel
from xtl.model.hf.peft_adapter import merge_peft_adapter
from xtl.strategies.layout import ParallelLayout, ParallelMeshes


class TransformStage(IntEnum):
    """Where a :class:`ModelTransform` runs in the ``parallelize`` sequence (lower runs first)."""

    MODEL = 1
    ACTIVATION = 2
    COMPILE = 3


class ModelTransform(ABC):
    """A callback that changes the model before it is distributed (mix into a ``lightning.Callback``).

    The model it receives is built on ``meta`` (no storage yet): a transform swaps or wraps modules, it does not
    touch weights. It must keep parameter names (``named_parameters``) unchanged unless it adds parameters of its
    own, so HF weights still load by name afterwards.

    Attributes:
        transform_stage: The stage the transform belongs to; within a stage, transforms run in callback order.
    """

    transform_stage: ClassVar[TransformStage] = TransformStage.MODEL

    @abstractmethod
    def transform_model(self, model: BaseModel) -> BaseModel:
        """Return the transformed model (the same object, changed in place, or a new one)."""

    def after_weights(self, model: BaseModel) -> BaseModel:
        """Called once the weights are loaded or initialized and the dtype set (e.g. to quantize frozen weights);
        returns the model (default: unchanged)."""
        return model

    def skipped_checkpoint_keys(self, model: BaseModel) -> set[str]:
        """Keys of ``model.state_dict()`` that training checkpoints leave out because the model source rebuilds
        them on resume (e.g. LoRA's frozen base weights); default: none."""
        return set()

    def reference_views(self, model: BaseModel) -> ReferenceViews | None:
        """How ``model`` computes without a copy of it as it did before training, when the transform trains parts
        of its own (LoRA: its adapters); ``None`` (the default) when it trains nothing of its own.

        A reference policy (:mod:`xtl.train.reference`) uses these views instead of a second copy of the model.
        """
        return None

    def weight_files(self) -> list[Path]:
        """Files the transform loads weights from besides the model's (LoRA: a PEFT adapter it continues from), for
        fingerprints of what a model computes (e.g. the key of a precomputed reference); default: none."""
        return []

    def export_hf(self, model: BaseModel, request: HFExportRequest) -> list[Path] | None:
        """Write an HF export the transform changes (e.g. LoRA: merged weights or a PEFT adapter).

        Called on every rank by :class:`~xtl.callbacks.HFExport`; at most one transform of a run may write it.

        Returns:
            The directories written (the tokenizer is copied into each), or ``None`` when the transform leaves the
            export to ``request.write_model(request.target, None)`` (the default).
        """
        return None

    def memory_settings(self) -> dict[str, Any]:
        """What the transform changes in a run's memory, as fields of ``xtl memory``'s ``TrainSetup`` (e.g.
        ``{"recompute": "full"}``); ``xtl memory --config`` asks every transform of a recipe. Default: nothing."""
        return {}

    def after_optimizer_step(self, model: BaseModel, applied: torch.Tensor) -> None:  # noqa: B027 - a no-op by default
        """Called after every optimizer step (e.g. to refresh state derived from the weights).

        Args:
            model: The trained model.
            applied: 1.0 when the update was applied, 0.0 when a non-finite gradient skipped it (a device tensor:
                scale by it rather than branch on it, which would read it back on the host).
        """


@dataclass
class HFExportRequest:
    """An HF export being written, as :meth:`ModelTransform.export_hf` sees it.

    Attributes:
        target: The export directory.
        dtype: Dtype of the exported tensors (``None``: the model's).
        write_model: Writes the HF model (config, safetensors, token ids) into a directory, each tensor passed
            through an optional ``(hf_key, tensor) -> tensor`` transform (every rank calls it; rank 0 writes).
    """

    target: Path
    dtype: torch.dtype | None
    write_model: Callable[[Path, Callable[[str, torch.Tensor], torch.Tensor] | None], None]


@dataclass(frozen=True)
class ReferenceViews:
    """What a model transform offers a reference policy: contexts in which the transformed model computes without
    the parts the transform trains, or with those parts as they were before training (no second copy of the model).

    Attributes:
        start: A context in which the model computes the starting policy (LoRA: the adapters as they were loaded, or
            off when they started fresh).
        base: A context in which the model computes without the transform's parts (LoRA: adapters off).
        base_is_start: Whether ``base`` is the starting policy (LoRA: the adapters started fresh, ``B = 0``).
        why_base_is_not_start: When it is not, why, naming the setting (e.g. ``LoRA.adapter_path``).
        describe_start: What ``start`` computes, for logs.
    """

    start: Callable[[], AbstractContextManager[None]]
    base: Callable[[], AbstractContextManager[None]]
    base_is_start: bool
    why_base_is_not_start: str = ""
    describe_start: str = "the starting policy"


@dataclass
class WeightSource:
    """Where the weights come from once the model is distributed.

    Attributes:
        hf_dir: HF directory to load with ``from_hf``; ``None`` initializes from ``seed``.
        seed: Seed of ``init_weights`` (each parameter derives its own seed from it and its name).
        dtype: Parameter dtype when the strategy does not manage precision itself.
        adapter_dir: A PEFT LoRA adapter merged into the loaded weights (a frozen reference model of its own).
    """

    hf_dir: Path | None = None
    seed: int = 0
    dtype: torch.dtype = torch.float32
    adapter_dir: Path | None = None


class ParallelizingStrategy(ABC):
    """A strategy that turns a meta-built model into a distributed, loaded one (mix into a Lightning strategy).

    :meth:`parallelize` is the fixed sequence of the module docstring; subclasses override the hooks only.
    ``root_device`` (the device this process computes on) comes from the Lightning strategy it is mixed into.

    Attributes:
        shards_parameters: Parameters become FSDP2 ``DTensor`` shards (whatever the number of ranks).
        layout: The sizes of the parallel dimensions (:class:`~xtl.strategies.layout.ParallelLayout`).
        meshes: Its meshes and process groups, once built.
    """

    root_device: torch.device
    shards_parameters: ClassVar[bool] = False
    layout: ParallelLayout = ParallelLayout()
    meshes: ParallelMeshes = ParallelMeshes(ParallelLayout(), None, None, None, None)

    @property
    def gathered_dtype(self) -> torch.dtype | None:
        """The dtype parameters are gathered and computed in (``None``: their own)."""
        return None

    @property
    def offloads_parameters(self) -> bool:
        """Sharded parameters live on the CPU between their uses (FSDP2's CPU offload)."""
        return False

    def finish_pending_save(self) -> None:
        """Complete a checkpoint still being written in the background, so that its files are all there (every rank
        calls it; a no-op unless the strategy saves asynchronously)."""
        return None

    def data_group(self) -> Any:
        """The process group the token count and router statistics sum over (``None``: one rank)."""
        return self.meshes.data_group()

    def world_group(self) -> Any:
        """The process group of every rank of the layout, which every sharded forward spans (``None``: one rank)."""
        return self.meshes.world_group()

    def parallelize(self, model: BaseModel, transforms: Sequence[ModelTransform], weights: WeightSource) -> BaseModel:
        """Run the ordered sequence on ``model`` (built on ``meta``) and return the trainable model."""
        for transform in sorted(transforms, key=lambda t: t.transform_stage):  # stable: callback order per stage
            model = transform.transform_model(model)
        model = self.apply_context_parallel(model)
        model = self.apply_expert_parallel(model)
        model = self.apply_data_parallel(model)
        if weights.hf_dir is not None:
            model.from_hf(weights.hf_dir, device=self.root_device)
        else:
            model.materialize(self.root_device)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(weights.seed)
                model.init_weights()
        model = self.apply_param_dtype(model, weights.dtype)
        if weights.adapter_dir is not None:  # in the parameters' own dtype (at least fp32 math)
            merge_peft_adapter(model, weights.adapter_dir)
        for transform in sorted(transforms, key=lambda t: t.transform_stage):
            model = transform.after_weights(model)
        return model

    def apply_context_parallel(self, model: BaseModel) -> BaseModel:
        """Make every decoder attention module attend the whole sequence of the ``cp`` group (Ulysses, or
        all-gather-KV where ``cp`` does not divide the heads); no-op at ``cp = 1``. A vision tower is not split:
        each rank encodes the images of its pack (:class:`xtl.model.compose.qwen3_vl.Qwen3VL`)."""
        group = self.meshes.cp_group()
        if group is None:
            return model
        for module in model.attention_modules():
            module.use_context_parallel(group)
        return model

    @contextmanager
    def whole_sequences(self, model: BaseModel) -> Iterator[None]:
        """Within the block every rank attends whole sequences of its own (decoding, which cannot split a sequence
        over ranks): the attention modules leave their context-parallel group and rejoin it after. A no-op without
        context parallelism. Parameters stay sharded: the ranks still decode in step."""
        if self.meshes.cp_group() is None:
            yield
            return
        modules = model.attention_modules()
        saved = [(module.context_group, module.context_parallel_method) for module in modules]
        for module in modules:
            module.context_group, module.context_parallel_method = None, None
        try:
            yield
        finally:
            for module, (group, method) in zip(modules, saved):
                module.context_group, module.context_parallel_method = group, method

    def apply_expert_parallel(self, model: BaseModel) -> BaseModel:
        """Split routed experts over the expert-parallel ranks (default: every expert stays on every rank)."""
        return model

    def apply_data_parallel(self, model: BaseModel) -> BaseModel:
        """Shard or replicate parameters over the data-parallel ranks (default: nothing to do)."""
        return model

    def apply_param_dtype(self, model: BaseModel, dtype: torch.dtype) -> BaseModel:
        """Give the parameters their training dtype (default: cast; sharding strategies use mixed precision).

        A cast to a 16-bit dtype is pure low-precision training (no fp32 master weights, 16-bit optimizer state):
        it is warned about; ``trainer.precision: bf16-mixed`` is the usual single-device choice.
        """
        if dtype == torch.float32:
            return model
        name = str(dtype).removeprefix("torch.")
        warnings.warn(
            f"param_dtype {name} without FSDP trains {name} parameters directly, with no fp32 master weights and a "
            "16-bit optimizer state; for mixed precision with fp32 master weights keep param_dtype float32 and set "
            "trainer.precision: bf16-mixed",
            stacklevel=2,
        )
        return model.to(dtype)

    def set_gradient_sync(self, model: BaseModel, enabled: bool) -> None:  # noqa: B027 - a no-op by default
        """Reduce gradients after the next backward (``False`` accumulates locally; default: nothing to sync)."""


class SingleDevice(ParallelizingStrategy):
    """The default when the trainer's strategy is not an xtl one: one process, the whole model on ``device``.

    Args:
        device: Where to materialize the model.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._device = torch.device(device)

    @property
    def root_device(self) -> torch.device:
        """The device given at construction."""
        return self._device


class ShardedStrategyMixin(ParallelizingStrategy):
    """Hooks shared by FSDP2 strategies: shard the model's shard units, then the root; mixed precision."""

    shards_parameters = True

    @abstractmethod
    def fsdp_kwargs(self) -> dict:
        """``fully_shard`` keyword arguments (``mesh``, ``mp_policy``, ``offload_policy``, ...)."""

    def apply_data_parallel(self, model: BaseModel) -> BaseModel:
        """FSDP2 ``fully_shard`` on each shard unit the model names, then on the root."""
        return fully_shard_model(model, **self.fsdp_kwargs())

    def apply_param_dtype(self, model: BaseModel, dtype: torch.dtype) -> BaseModel:
        """Parameters stay fp32 masters; FSDP's ``MixedPrecisionPolicy`` sets the compute dtype."""
        return model

    def set_gradient_sync(self, model: BaseModel, enabled: bool) -> None:
        """FSDP2 ``set_requires_gradient_sync``: reduce-scatter only after the step's last micro-batch."""
        from torch.distributed.fsdp import FSDPModule

        sharded = cast(FSDPModule, model)  # apply_data_parallel made the model an FSDPModule
        sharded.set_requires_gradient_sync(enabled)


def fully_shard_model(model: BaseModel, **fsdp_kwargs: Any) -> BaseModel:
    """FSDP2 ``fully_shard`` on each of ``model.shard_units()``, then on the root, with the same arguments.

    A module inside a unit that keeps parameters in fp32 (its ``keep_fp32`` names, e.g. DeepSeek-V3's router) is
    sharded on its own first, without the ``param_dtype`` cast, so it computes as it does unsharded.
    """
    from torch.distributed.fsdp import fully_shard

    policy = fsdp_kwargs.get("mp_policy")
    fp32_kwargs = {**fsdp_kwargs}
    if policy is not None and policy.param_dtype is not None:
        fp32_kwargs["mp_policy"] = replace(policy, param_dtype=None)
    fp32 = {id(module) for module in model.fp32_modules()}
    for unit in model.shard_units():
        for module in unit.modules():
            if id(module) in fp32:
                fully_shard(module, **fp32_kwargs)
        fully_shard(unit, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model
