"""The parallel layout: one object that names every parallel dimension, its size, its mesh and its process group.

Ranks are laid out as ``dp_replicate x dp_shard x cp`` (``cp`` innermost):

- ``dp_replicate`` x ``dp_shard``: data parallelism; every such rank reads its own data. Parameters are sharded
  over ``dp_shard`` (FSDP2) and replicated over ``dp_replicate`` (HSDP when it is > 1: replicate across nodes,
  shard within one).
- ``cp``: context parallelism; the ranks of a ``cp`` group (consecutive ranks) share one packed sequence, each
  holding ``1 / cp`` of its tokens (attention exchanges heads for tokens, :mod:`xtl.ops.ulysses`), and shard
  parameters with ``dp_shard``.
- ``ep``: expert parallelism inside the shard group: the routed experts are split over ``ep`` ranks and each expert
  slice is FSDP-sharded over the ``edp = dp_shard * cp / ep`` others.

:class:`ParallelLayout` holds the sizes (plain data, no process groups, usable anywhere, e.g. by ``xtl memory``);
:meth:`ParallelLayout.build` makes the :class:`ParallelMeshes` a strategy trains with. Every collective names the
group it means, never the process's default group: the token count and the router statistics sum over
:meth:`ParallelMeshes.data_group`, ranks agree on their forwards and share rank 0's results over
:meth:`ParallelMeshes.world_group` (:func:`broadcast_object`), attention exchanges over the ``cp`` mesh, experts
exchange tokens over the ``ep`` mesh, and the data module reads :meth:`ParallelLayout.data_rank` and ``dp_size``
(handed over by the training module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from xtl.errors import ConfigError

KEY = "trainer.strategy.init_args"
T = TypeVar("T")


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel dimensions (world size = ``dp_replicate * dp_shard * cp``).

    Attributes:
        dp_replicate: Replicas of each parameter shard (HSDP).
        dp_shard: Ranks a parameter is sharded over (with ``cp``).
        cp: Ranks that share one sequence (context parallelism).
        ep: Ranks the routed experts of an MoE layer are split over (inside ``dp_shard * cp``).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel layout: {name} must be a whole number >= 1, got {value!r}")
        if self.shard_size % self.ep:
            raise ConfigError(
                f"{KEY}.expert_parallel_size ({self.ep}) must divide the ranks a parameter is sharded over "
                f"({self.shard_size}); choose a divisor"
            )
        if self.ep > 1 and self.dp_replicate > 1:
            raise ConfigError(
                f"{KEY}.expert_parallel_size > 1 needs data_parallel_replicate_size: 1 (HSDP with expert "
                "parallelism is not supported)"
            )

    @classmethod
    def for_world(
        cls,
        world_size: int,
        dp_replicate: int = 1,
        dp_shard: int | Literal["auto"] = "auto",
        ep: int = 1,
        cp: int = 1,
    ) -> ParallelLayout:
        """The layout of ``world_size`` ranks; ``dp_shard: auto`` takes what replication and ``cp`` leave.

        Raises:
            ConfigError: The sizes do not multiply to the world size, naming the strategy's keys.
        """
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or world_size % cp:
            raise ConfigError(
                f"{KEY}.context_parallel_size ({cp}) must divide the number of processes ({world_size} = "
                "trainer.num_nodes x trainer.devices)"
            )
        shard = world_size // (dp_replicate * cp) if dp_shard == "auto" else int(dp_shard)
        if dp_replicate < 1 or dp_replicate * shard * cp != world_size:
            raise ConfigError(
                f"{KEY}: data_parallel_replicate_size ({dp_replicate}) x data_parallel_shard_size ({shard}) x "
                f"context_parallel_size ({cp}) must equal the number of processes ({world_size} = "
                "trainer.num_nodes x trainer.devices)"
            )
        return cls(dp_replicate=dp_replicate, dp_shard=shard, cp=cp, ep=ep)

    @property
    def world_size(self) -> int:
        """All ranks."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def dp_size(self) -> int:
        """Ranks that read different data (``dp_replicate * dp_shard``)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_size(self) -> int:
        """Ranks a dense parameter is sharded over (``dp_shard * cp``: the ``cp`` ranks shard parameters too)."""
        return self.dp_shard * self.cp

    @property
    def edp(self) -> int:
        """Ranks each expert slice is FSDP-sharded over (``dp_shard * cp / ep``)."""
        return self.shard_size // self.ep

    @property
    def sharded(self) -> bool:
        """Parameters are sharded or replicated over more than one rank."""
        return self.world_size > 1

    def data_rank(self, rank: int) -> int:
        """The data-parallel rank of global ``rank`` (the ranks of one ``cp`` group read the same data)."""
        return rank // self.cp

    def context_rank(self, rank: int) -> int:
        """Which share of its group's sequence global ``rank`` holds (``0 .. cp - 1``)."""
        return rank % self.cp

    def describe(self) -> str:
        """``dp_replicate 2 x dp_shard 4 x cp 1, ep 2 (edp 2)``."""
        text = f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x cp {self.cp}"
        return text + (f", ep {self.ep} (edp {self.edp})" if self.ep > 1 else "")

    def build(self, device_type: str) -> ParallelMeshes:
        """The device meshes and process groups of this layout (collective: every rank calls it)."""
        if self.world_size == 1:
            return ParallelMeshes(self, None, None, None, None)
        cp = None
        if self.cp > 1:  # consecutive ranks share a sequence
            cp = init_device_mesh(device_type, (self.world_size // self.cp, self.cp), mesh_dim_names=("rest", "cp"))
            cp = cp["cp"]
        if self.ep > 1:
            mesh = init_device_mesh(device_type, (self.edp, self.ep), mesh_dim_names=("edp", "ep"))
            fsdp = mesh["edp", "ep"]._flatten("dp_shard")
            return ParallelMeshes(self, fsdp, fsdp, mesh["ep"], mesh["edp"], cp)
        mesh = init_device_mesh(
            device_type, (self.dp_replicate, self.shard_size), mesh_dim_names=("dp_replicate", "dp_shard")
        )
        data = mesh["dp_replicate", "dp_shard"]._flatten("data")
        fsdp = mesh if self.dp_replicate > 1 else mesh["dp_shard"]
        return ParallelMeshes(self, data, fsdp, None, None, cp)


@dataclass
class ParallelMeshes:
    """The meshes a strategy built for a :class:`ParallelLayout` (``None`` where a dimension is absent).

    Attributes:
        layout: The sizes.
        data: Every rank (1-D): the token count, the loss and the router statistics sum over it.
        fsdp: What dense parameters are sharded over: 1-D (``dp_shard``), or 2-D (``dp_replicate``, ``dp_shard``)
            for HSDP.
        ep: This rank's expert-parallel group.
        edp: This rank's expert-data-parallel group (each expert slice is sharded over it).
        cp: This rank's context-parallel group (the ranks that share its sequence).
    """

    layout: ParallelLayout
    data: DeviceMesh | None
    fsdp: DeviceMesh | None
    ep: DeviceMesh | None
    edp: DeviceMesh | None
    cp: DeviceMesh | None = None

    def data_group(self) -> dist.ProcessGroup | None:
        """The process group of :attr:`data` (``None`` on one rank): the ranks whose tokens make up a step (each
        ``cp`` rank holds a share of its sequence), over which token counts, losses and statistics sum."""
        return None if self.data is None else self.data.get_group()

    def world_group(self) -> dist.ProcessGroup | None:
        """Every rank of the layout (``None`` on one rank): the ranks every sharded forward spans, which must run
        as many forwards as each other and share what one of them computed (evaluation results). The data mesh
        spans them all in every layout xtl builds; the process's default group need not be this group (several
        runs may share one process group)."""
        return self.data_group()

    def cp_group(self) -> dist.ProcessGroup | None:
        """The process group of :attr:`cp` (``None`` without context parallelism)."""
        return None if self.cp is None else self.cp.get_group()


def broadcast_object(obj: T, group: dist.ProcessGroup | None) -> T:
    """The first rank of ``group``'s ``obj`` (any picklable object), on every rank of ``group`` (collective over it);
    ``obj`` itself when ``group`` is ``None`` (one rank)."""
    if group is None:
        return obj
    shared = [obj]
    dist.broadcast_object_list(shared, group=group, group_src=0)
    return shared[0]
