"""FSDP2 data parallelism on Lightning's ModelParallelStrategy, with atomic distributed checkpoints."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from xtl.errors import ConfigError
from xtl.model import BaseModel
from xtl.strategies.checkpoint_io import raise_if_unreadable
from xtl.strategies.expert_parallel import shard_experts, split_experts
from xtl.strategies.layout import ParallelLayout
from xtl.strategies.parallelize import ShardedStrategyMixin

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

    Checkpoints are DCP directories written atomically (temporary name, then rename), so a run killed mid-save
    resumes from the previous good checkpoint.

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
        **kwargs: Any,
    ) -> None:
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
        self._expert_modules: list = []

    def setup_environment(self) -> None:
        """Set explicit sizes (Lightning's defaults are per node), then lay the ranks out and build the meshes."""
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()
        if self.cpu_offload and self.root_device.type == "cpu":
            raise ConfigError(
                "trainer.strategy.init_args.cpu_offload moves GPU parameters, gradients and optimizer states to the "
                "CPU; with accelerator cpu they are on the CPU already: remove cpu_offload (or train on GPUs)"
            )
        replicate, shard = self.data_parallel_replicate_size, self.data_parallel_shard_size
        self.layout = ParallelLayout.for_world(self.world_size, replicate, shard, self.expert_parallel_size)
        self.meshes = self.layout.build(self.root_device.type)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """The sampler's rank and number of replicas: the data-parallel ones of the layout."""
        return {"num_replicas": self.layout.dp_size, "rank": self.layout.data_rank(self.global_rank)}

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
        """Write to a temporary sibling, then replace ``filepath`` atomically (rank 0 renames)."""
        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(f".{path.name}.tmp")
        if self.global_rank == 0 and tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        self.barrier()
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier()
        if self.global_rank == 0:
            _replace(tmp, path)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a DCP directory (or a full checkpoint file) after checking it is whole.

        Raises:
            CheckpointError: On every rank, naming the damaged checkpoint and the newest intact one beside it.
        """
        path = Path(self.broadcast(str(checkpoint_path)))
        raise_if_unreadable(path)
        return super().load_checkpoint(path, weights_only=weights_only)


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
