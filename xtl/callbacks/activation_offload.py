"""Activation offload: what decoder layers save for backward waits in host memory instead of device memory."""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from xtl.callbacks._layers import check_layer_options, chosen_stacks, select_layers
from xtl.model import BaseModel
from xtl.strategies.parallelize import ModelTransform, TransformStage


@dataclass
class OffloadStats:
    """Counts of what :class:`ActivationOffload` did (cumulative; :meth:`reset` clears them).

    Attributes:
        offloaded_bytes: Bytes copied from the compute device to host memory.
        offloaded_tensors: Saved tensors served from a host copy.
        kept_bytes: Bytes of saved tensors left in place (views of the layer's parameters or buffers).
        kept_tensors: Saved tensors left in place.
        held_bytes: Bytes in host copies now (not cumulative: a copy is released once backward is done with it).
    """

    offloaded_bytes: int = 0
    offloaded_tensors: int = 0
    kept_bytes: int = 0
    kept_tensors: int = 0
    held_bytes: int = 0

    def reset(self) -> None:
        """Set every cumulative count to 0 (``held_bytes`` follows the live copies)."""
        self.offloaded_bytes = self.offloaded_tensors = self.kept_bytes = self.kept_tensors = 0


class ActivationOffload(pl.Callback, ModelTransform):
    """Move the activations that chosen blocks save for backward to host memory (stage ``ACTIVATION``).

    The blocks are the model's decoder layers and, for vision-language models, its vision blocks
    (:meth:`~xtl.model.BaseModel.layer_stacks`; ``parts`` chooses among them).

    While a chosen layer runs forward (with gradients on), ``torch.autograd.graph.saved_tensors_hooks`` copy
    every tensor autograd saves into host memory; backward copies it back. Storages are copied whole, once per
    layer call, so views keep their exact layout and a tensor saved by several ops moves once. Tensors that
    share storage with the layer's parameters or buffers are never offloaded (checked by storage at hook time,
    so FSDP2's gathered weights and their views such as ``w.t()`` stay where they are).

    - On CUDA the copies use pinned host buffers (pooled and reused across steps) and a side stream, so they
      overlap compute; in backward the first use of a layer's tensors also prefetches the tensors of the layer
      before it (the next one backward needs).
    - On CPU there is no device memory to free: the tensors are still copied into separate host buffers (and
      counted), which exercises the same path and keeps results bitwise equal, but does not lower memory.

    With :class:`~xtl.callbacks.ActivationCheckpointing` on the same layer, what the checkpointed layer saves
    (its inputs) is offloaded, and recomputation in backward is left alone.

    Args:
        layers: Indices of the layers to offload within each part (default: chosen by ``every_n_layers``).
        every_n_layers: Offload layers ``i`` with ``i % every_n_layers == 0`` within each part (1: every layer).
        pin_memory: Use pinned host buffers on CUDA (needed for copies that overlap compute).
        prefetch: In backward, start bringing back the previous layer's tensors early (CUDA).
        parts: The parts whose blocks are offloaded (``language``, ``vision``; ``None``: all the model has).

    Attributes:
        stats: What was offloaded so far (:class:`OffloadStats`).
        offloaded_layers: Part -> indices of the blocks the hooks were installed on.
    """

    transform_stage = TransformStage.ACTIVATION

    def __init__(
        self,
        layers: list[int] | None = None,
        every_n_layers: int = 1,
        pin_memory: bool = True,
        prefetch: bool = True,
        parts: list[str] | None = None,
    ) -> None:
        check_layer_options(every_n_layers, layers)
        self.layers = layers
        self.every_n_layers = every_n_layers
        self.parts = parts
        self.stats = OffloadStats()
        self.offloaded_layers: dict[str, list[int]] = {}
        self._offloader = _Offloader(self.stats, pin_memory=pin_memory, prefetch=prefetch)
        self._logged_bytes = 0

    def transform_model(self, model: BaseModel) -> BaseModel:
        """Install the offload hooks on the chosen blocks (names and structure unchanged).

        Blocks are numbered in forward order across the parts (vision blocks before decoder layers), which is the
        order backward prefetches in.
        """
        self.offloaded_layers = {}
        order = 0
        for part, stack in chosen_stacks(model, self.parts, "ActivationOffload.parts").items():
            self.offloaded_layers[part] = select_layers(len(stack), self.every_n_layers, self.layers, part)
            for index in self.offloaded_layers[part]:
                self._offloader.attach(stack[index], order + index)
            order += len(stack)
        return model

    def memory_settings(self) -> dict[str, Any]:
        """The offloaded decoder layers, for ``xtl memory --config``."""
        layers = tuple(self.layers) if self.layers is not None else None
        return {"offload": True, "offload_every_n_layers": self.every_n_layers, "offload_layers": layers}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log ``train/offloaded_gib``: GiB copied to host memory during the step."""
        step_bytes = self.stats.offloaded_bytes - self._logged_bytes
        self._logged_bytes = self.stats.offloaded_bytes
        pl_module.log("train/offloaded_gib", step_bytes / 2**30, on_step=True, on_epoch=False, batch_size=1)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Release the pooled host buffers."""
        self._offloader.release_buffers()


# ---- private ---------------------------------------------------------------------------------------------------


class _HostCopy:
    """One device storage copied to host memory, restored to the device at most once for backward."""

    __slots__ = ("__weakref__", "device", "group", "host", "restored", "restored_event")

    def __init__(self, host: torch.Tensor, device: torch.device, group: _Group) -> None:
        self.host = host  # uint8, the storage's bytes (on CUDA written by the side stream, read back after it)
        self.device = device
        self.group = group
        self.restored: torch.Tensor | None = None
        self.restored_event: Any = None


@dataclass
class _Saved:
    """A saved tensor's place in a host copy (its storage) and its layout."""

    copy: _HostCopy
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _Group:
    """The host copies of one forward call of one layer."""

    __slots__ = ("__weakref__", "by_storage", "copies", "index", "kept_storages", "previous")

    def __init__(self, index: int, kept_storages: set[int], previous: _Group | None) -> None:
        self.index = index
        self.kept_storages = kept_storages
        # forward only: one copy per (storage, version). Keyed by the storage object, not its address: a storage that
        # FSDP2 frees inside the layer (a sub-unit resharded after its forward, e.g. expert-parallel experts) gives
        # its address to the next allocation. The device tensor is held so the storage object outlives the call.
        self.by_storage: dict[tuple[int, int], tuple[_HostCopy, torch.Tensor]] = {}
        self.copies: list[weakref.ref[_HostCopy]] = []
        self.previous = weakref.ref(previous) if previous is not None else None


class _Offloader:
    """The pack/unpack hooks and the copy machinery shared by the offloaded layers."""

    def __init__(self, stats: OffloadStats, pin_memory: bool, prefetch: bool) -> None:
        self.stats = stats
        self.pin_memory = pin_memory
        self.prefetch = prefetch
        self._active: dict[int, list[Any]] = defaultdict(list)  # id(layer) -> (context, group) entered, or None
        self._last_group: _Group | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pool: dict[int, list[torch.Tensor]] = defaultdict(list)  # pinned buffers by size

    def attach(self, layer: nn.Module, index: int) -> None:
        """Offload what ``layer`` saves: enter the hooks before any other pre-hook, leave them after the rest."""

        def enter(module: nn.Module, args: Any) -> None:
            self._active[id(module)].append(self._enter(module, index))

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            entered = self._active[id(module)].pop()
            if entered is not None:
                context, group = entered
                context.__exit__(None, None, None)
                group.by_storage.clear()

        # eager even inside a compiled layer (Dynamo must not trace host copies, pools and finalizers)
        layer.register_forward_pre_hook(torch.compiler.disable(enter), prepend=True)
        layer.register_forward_hook(torch.compiler.disable(leave), always_call=True)

    def release_buffers(self) -> None:
        """Drop the pooled pinned buffers."""
        self._pool.clear()

    # -- forward: pack -----------------------------------------------------------------------------------------

    def _enter(self, layer: nn.Module, index: int) -> tuple[Any, _Group] | None:
        # no graph (eval), or a recomputation inside backward (activation checkpointing): nothing to offload
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return None
        kept = {_storage_ptr(t) for t in (*layer.parameters(), *layer.buffers())}
        previous = self._last_group if self._last_group is not None and self._last_group.index < index else None
        group = _Group(index, kept, previous)
        self._last_group = group
        pack = torch.compiler.disable(functools.partial(self._pack, group))
        context = torch.autograd.graph.saved_tensors_hooks(pack, torch.compiler.disable(self._unpack))
        context.__enter__()
        return context, group

    def _pack(self, group: _Group, tensor: torch.Tensor) -> Any:
        if not _offloadable(tensor) or _storage_ptr(tensor) in group.kept_storages:
            self.stats.kept_tensors += 1
            self.stats.kept_bytes += tensor.numel() * tensor.element_size()
            return tensor
        storage = tensor.untyped_storage()
        key = (storage._cdata, tensor._version)
        if key in group.by_storage:
            copy = group.by_storage[key][0]
        else:
            copy = self._offload(storage, tensor.device, group)
            group.by_storage[key] = (copy, tensor)
            group.copies.append(weakref.ref(copy))
            self.stats.offloaded_bytes += storage.nbytes()
        self.stats.offloaded_tensors += 1
        return _Saved(copy, tensor.dtype, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _offload(self, storage: torch.UntypedStorage, device: torch.device, group: _Group) -> _HostCopy:
        data = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        if device.type != "cuda":  # CPU: a separate host buffer; other devices: a synchronous copy
            copy = _HostCopy(data.to("cpu", copy=True), device, group)
            weakref.finalize(copy, self._release, data.numel(), None)
        else:
            stream = self._stream(device)
            host = self._take_buffer(data.numel())
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                host.copy_(data, non_blocking=self.pin_memory)
            data.record_stream(stream)  # the allocator keeps the device memory until the copy is done
            copy = _HostCopy(host, device, group)
            # back to the pool once backward is done with it (later copies into it queue behind on the stream)
            weakref.finalize(copy, self._release, data.numel(), host if self.pin_memory else None)
        self.stats.held_bytes += data.numel()
        return copy

    def _release(self, nbytes: int, pinned: torch.Tensor | None) -> None:
        self.stats.held_bytes -= nbytes
        if pinned is not None:
            self._pool[nbytes].append(pinned)

    # -- backward: unpack --------------------------------------------------------------------------------------

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        copy = saved.copy
        data = self._restore(copy)
        if self.prefetch and copy.group.previous is not None:
            previous = copy.group.previous()
            if previous is not None:
                for ref in previous.copies:
                    if (other := ref()) is not None:
                        self._start_restore(other)
        out = torch.empty(0, dtype=saved.dtype, device=data.device)
        return out.set_(data.untyped_storage(), saved.offset, saved.size, saved.stride)

    def _restore(self, copy: _HostCopy) -> torch.Tensor:
        if copy.device.type == "cpu":
            return copy.host
        if copy.device.type != "cuda":
            if copy.restored is None:
                copy.restored = copy.host.to(copy.device)
            return copy.restored
        self._start_restore(copy)
        current = torch.cuda.current_stream(copy.device)
        current.wait_event(copy.restored_event)
        copy.restored.record_stream(current)
        return copy.restored

    def _start_restore(self, copy: _HostCopy) -> None:
        if copy.restored is not None or copy.device.type != "cuda":
            return
        stream = self._stream(copy.device)  # after the device-to-host copy: same stream
        with torch.cuda.stream(stream):
            copy.restored = copy.host.to(copy.device, non_blocking=self.pin_memory)
            copy.restored_event = stream.record_event()

    # -- helpers -----------------------------------------------------------------------------------------------

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _take_buffer(self, nbytes: int) -> torch.Tensor:
        free = self._pool[nbytes]
        return free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)


def _offloadable(tensor: torch.Tensor) -> bool:
    """Plain strided tensors with storage on a real device (not meta, not a tensor subclass, not empty)."""
    return (
        type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.layout == torch.strided
        and tensor.device.type != "meta"
        and tensor.numel() > 0
    )


def _storage_ptr(tensor: torch.Tensor) -> int:
    """Address of the storage behind ``tensor`` (the local shard of a DTensor), -1 for none."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return -1
