"""FSDP2 data parallelism on Lightning's ModelParallelStrategy, with atomic distributed checkpoints."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from xtl.errors import ConfigError
from xtl.model import BaseModel
from xtl.strategies.capability import check_context_parallel
from xtl.strategies.checkpoint_io import LIGHTNING_METADATA, raise_if_unreadable
from xtl.strategies.expert_parallel import shard_experts, split_experts
from xtl.strategies.layout import ParallelLayout
from xtl.strategies.parallelize import ShardedStrategyMixin
from xtl.strategies.restart import attempt_store

DtypeName = Literal["float32", "bfloat16", "float16"]


class FSDPStrategy(ShardedStrategyMixin, ModelParallelStrategy):
    """Fully sharded data parallelism (FSDP2 ``fully_shard``) with explicit sizes and mixed precision.

    The ranks are laid out by a :class:`~xtl.strategies.layout.ParallelLayout`: ``data_parallel_replicate_size x
    data_parallel_shard_size`` (HSDP when the replicate size is > 1, e.g. replicated across nodes and sharded within
    one); their product must equal the number of processes. It owns the ``parallelize`` sequence
    (:class:`~xtl.strategies.parallelize.ParallelizingStrategy`): the model's shard units are sharded, then the root.

    With ``expert_parallel_size`` > 1 the shard group is split into ``(edp, ep)``
    (:mod:`xtl.strategies.expert_parallel`): MoE experts are split over ``ep`` and exchange tokens by all-to-all,
    and every rank still sees different data.

    With ``context_parallel_size`` (``cp``) > 1, each group of ``cp`` consecutive ranks trains one packed sequence:
    every rank holds ``1 / cp`` of its tokens (split on the host, :func:`xtl.data.collate.split_for_context_parallel`)
    and attention exchanges heads for tokens (Ulysses, :mod:`xtl.ops.ulysses`; all-gather-KV where ``cp`` does not
    divide the heads, :mod:`xtl.ops.allgather_kv`); the ``cp`` ranks shard the
    parameters with the others. ``data_parallel_shard_size`` is then what ``cp`` and replication leave.

    Checkpoints are DCP directories written atomically (temporary name, then rename), so a run killed mid-save
    resumes from the previous good checkpoint. With ``async_save`` the tensors of a checkpoint are copied to CPU
    memory and written by a background thread while training goes on; the rename waits until the write is complete
    on every rank, and happens at the latest before the next save, before a load, before a pending checkpoint is
    removed, and at teardown.

    Args:
        data_parallel_shard_size: Ranks a parameter is sharded over (``"auto"``: world size / replicate size).
        data_parallel_replicate_size: Replicas of each shard group (HSDP).
        param_dtype: Compute dtype of gathered parameters (``None``: the parameters' own dtype).
        reduce_dtype: Dtype of gradient reduction.
        reshard_after_forward: Free gathered parameters after forward (ZeRO-3) rather than keep them (ZeRO-2).
        cpu_offload: Keep sharded parameters, gradients and optimizer states on CPU.
        save_distributed_checkpoint: DCP directory checkpoints (else a full checkpoint file from rank 0).
        process_group_backend: ``gloo``/``nccl`` (default from the device).
        expert_parallel_size: Ranks the routed experts of each MoE layer are split over (divides the world size
            and the expert count; 1: every rank holds every expert).
        context_parallel_size: Ranks that share one packed sequence (divides the world size; Ulysses attention
            where it divides the query heads, all-gather-KV attention elsewhere; 1: every rank trains whole
            sequences).
        async_save: Write the model and optimizer state of distributed checkpoints in the background
            (``torch.distributed.checkpoint.async_save``: staged to CPU memory, then written while training
            continues); needs ``save_distributed_checkpoint``.
        **kwargs: Other ``ModelParallelStrategy`` arguments (``timeout``, ...).
    """

    def __init__(
        self,
        data_parallel_shard_size: int | Literal["auto"] = "auto",
        data_parallel_replicate_size: int = 1,
        param_dtype: DtypeName | None = None,
        reduce_dtype: DtypeName | None = "float32",
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
        if async_save and not save_distributed_checkpoint:
            raise ConfigError(
                "trainer.strategy.init_args.async_save writes distributed (DCP) checkpoints in the background; with "
                "save_distributed_checkpoint: false there are none: remove async_save or set "
                "save_distributed_checkpoint: true"
            )
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            **kwargs,
        )
        self.data_parallel_shard_size = data_parallel_shard_size
        self.data_parallel_replicate_size = data_parallel_replicate_size
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.expert_parallel_size = expert_parallel_size
        self.context_parallel_size = context_parallel_size
        self.async_save = async_save
        self._expert_modules: list = []
        self._pending_save: _PendingSave | None = None
        self._checkpoint_group: torch.distributed.ProcessGroup | None = None
        self._interrupted = False

    def setup_environment(self) -> None:
        """Set explicit sizes (Lightning's defaults are per node), then lay the ranks out, refuse the run's features
        that do not run on the layout (:func:`~xtl.strategies.capability.check_context_parallel`: once, before any
        data is prepared) and build the meshes."""
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()
        if self.cpu_offload and self.root_device.type == "cpu":
            raise ConfigError(
                "trainer.strategy.init_args.cpu_offload moves GPU parameters, gradients and optimizer states to the "
                "CPU; with accelerator cpu they are on the CPU already: remove cpu_offload (or train on GPUs)"
            )
        replicate, shard = self.data_parallel_replicate_size, self.data_parallel_shard_size
        self.layout = ParallelLayout.for_world(
            self.world_size, replicate, shard, self.expert_parallel_size, self.context_parallel_size
        )
        module = self.lightning_module
        if module is not None:
            trainer = module.trainer
            check_context_parallel(self.layout, [module, *trainer.callbacks], trainer.state.fn.value)
        self.meshes = self.layout.build(self.root_device.type)

    def _setup_distributed(self) -> None:
        """Lightning's, but under torchrun each launch attempt's process group keeps its keys apart from those of
        the attempt before (:func:`xtl.strategies.restart.attempt_store`), so a restarted job finds its own ranks."""
        store = attempt_store(self._timeout)
        if store is None:
            super()._setup_distributed()
            return
        ParallelStrategy.setup_environment(self)
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        device = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device, store=store
        )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """The sampler's rank and number of replicas: the data-parallel ones of the layout."""
        return {"num_replicas": self.layout.dp_size, "rank": self.layout.data_rank(self.global_rank)}

    @property
    def offloads_parameters(self) -> bool:
        """``cpu_offload``."""
        return self.cpu_offload

    @property
    def gathered_dtype(self) -> torch.dtype | None:
        """``param_dtype``: what FSDP2 gathers the parameters in for compute."""
        return getattr(torch, self.param_dtype) if self.param_dtype else None

    def apply_expert_parallel(self, model: BaseModel) -> BaseModel:
        """Split the routed experts over ``ep`` and install the all-to-all dispatcher (no-op without EP)."""
        if self.meshes.ep is not None:
            self._expert_modules = split_experts(model, self.meshes.ep)
        return model

    def apply_data_parallel(self, model: BaseModel) -> BaseModel:
        """FSDP2: expert modules over ``edp`` (with EP), then the shard units and the root over the FSDP mesh."""
        if self.meshes.ep is not None:
            shard_experts(self._expert_modules, self.meshes, self.fsdp_kwargs())
        return super().apply_data_parallel(model)

    def fsdp_kwargs(self) -> dict:
        """``fully_shard`` arguments: the data-parallel mesh, mixed precision, resharding and CPU offload."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        return {
            "mesh": self.meshes.fsdp,
            # the model casts its own inputs where it must (as it does unsharded in the same dtype), so FSDP leaves
            # them alone: a layer sees exactly what it sees on one device, and parity with transformers holds
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=getattr(torch, self.param_dtype) if self.param_dtype else None,
                reduce_dtype=getattr(torch, self.reduce_dtype) if self.reduce_dtype else None,
                cast_forward_inputs=False,
            ),
            "reshard_after_forward": self.reshard_after_forward,
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        }

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        """Write to a temporary sibling, then replace ``filepath`` atomically (rank 0 renames; in a folder local to
        each node, each node's first rank renames its node's part).

        With ``async_save`` the tensors are written in the background and the rename is left to
        :meth:`finish_pending_save`; a save still pending from before is finished first.
        """
        self.finish_pending_save()
        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(f".{path.name}.tmp")
        if self.local_rank == 0 and tmp.exists():  # each node: a folder local to the node has its own leftover
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        self.barrier()
        if self.async_save:
            self._pending_save = self._start_async_save(checkpoint, tmp, path, storage_options)
            return
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier()
        self._rename_into_place(tmp, path)

    def finish_pending_save(self) -> None:
        """Wait for the pending background save, then rename it into place (rank 0); a no-op without one.

        Every rank calls it (at the next save, a load, a removal of the pending checkpoint, teardown). Rank 0's
        future resolves only after DCP's coordinator wrote ``.metadata``, which it does once it has gathered the
        result of every rank's finished (and fsynced) writes, so the directory is complete when rank 0 renames.
        The barrier after the rename keeps the other ranks from going on (e.g. to a load) before it.
        """
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        pending.future.result()
        if self._interrupted:  # the other ranks may be gone: rank 0's part only
            if self.global_rank == 0:
                _replace(pending.tmp, pending.path)
            return
        self._rename_into_place(pending.tmp, pending.path)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a DCP directory (or a full checkpoint file) after checking it is whole (a pending save finished
        first).

        Raises:
            CheckpointError: On every rank, naming the damaged checkpoint and the newest intact one beside it.
        """
        self.finish_pending_save()
        path = Path(self.broadcast(str(checkpoint_path)))
        raise_if_unreadable(path)
        return super().load_checkpoint(path, weights_only=weights_only)

    def remove_checkpoint(self, filepath: str | Path) -> None:
        """Remove a checkpoint; one still being written is finished first (else the rename would bring it back)."""
        pending = self._pending_save
        if pending is not None and os.path.abspath(filepath) == os.path.abspath(pending.path):
            self.finish_pending_save()
        super().remove_checkpoint(filepath)

    def on_exception(self, exception: BaseException) -> None:
        """Remember the interruption: teardown then finishes a pending save without waiting for the other ranks."""
        self._interrupted = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Finish a pending save (the fit's last checkpoint lands under its name), then tear down."""
        try:
            if self._interrupted:
                try:
                    self.finish_pending_save()
                except Exception as err:  # the run is failing already: keep its error, leave the temporary copy
                    rank_zero_warn(f"the checkpoint being written when the run stopped was not finished: {err}")
            else:
                self.finish_pending_save()
        finally:
            if self._checkpoint_group is not None:
                torch.distributed.destroy_process_group(self._checkpoint_group)
                self._checkpoint_group = None
            self._interrupted = False
            super().teardown()

    def _rename_into_place(self, tmp: Path, path: Path) -> None:
        """Rank 0 replaces ``path`` by the complete ``tmp``; then, where ``tmp`` is still there (a folder local to
        each node, e.g. a node-local staging folder of a remote checkpoint, holds each node's ranks' shards), the
        node's first rank renames its part. Every rank calls it."""
        if self.global_rank == 0:
            _replace(tmp, path)
        self.barrier("rename_into_place")
        if self.global_rank != 0 and self.local_rank == 0 and tmp.exists():
            _replace(tmp, path)
        self.barrier("rename_into_place")

    def _start_async_save(
        self, checkpoint: dict[str, Any], tmp: Path, path: Path, storage_options: Any
    ) -> _PendingSave:
        """``ModelParallelStrategy.save_checkpoint``'s split: tensors by DCP (here in the background), the rest
        (loops, callbacks, hyperparameters) by rank 0 into ``meta.pt`` now."""
        from torch.distributed.checkpoint import async_save

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        tmp.mkdir(parents=True, exist_ok=True)
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        # staged (copied to CPU) before async_save returns, so the next optimizer step cannot change what is written
        future = async_save(tensors, checkpoint_id=tmp, process_group=self._checkpoint_process_group())
        if self.global_rank == 0:
            torch.save(checkpoint, tmp / LIGHTNING_METADATA)
        return _PendingSave(future, tmp, path)

    def _checkpoint_process_group(self) -> torch.distributed.ProcessGroup | None:
        """A gloo group of all ranks for the background writer's collectives, so that they never interleave with
        the training's collectives on the default group (and async saving works on an NCCL-only default group).
        Created at the first save, which every rank makes."""
        if self._checkpoint_group is None and torch.distributed.is_initialized():
            self._checkpoint_group = torch.distributed.new_group(backend="gloo", timeout=self._timeout)
        return self._checkpoint_group


@dataclass
class _PendingSave:
    """A checkpoint written in the background into ``tmp``, to be renamed to ``path`` once complete."""

    future: Future
    tmp: Path
    path: Path


def _replace(src: Path, dst: Path) -> None:
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        if old.exists():
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.replace(src, dst)
