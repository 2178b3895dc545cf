"""Expert parallelism: the shard group split into ``(edp, ep)`` (:mod:`xtl.strategies.layout`), experts over ``ep``.

The data-parallel ranks ``dp_shard = edp x ep`` all see different data. Dense parameters are FSDP-sharded over
all of them; each MoE layer's routed experts are split on their expert dimension over ``ep`` (a ``DTensor``
``Shard(0)``; rank ``r`` of an ``ep`` group holds experts ``r*E/ep .. (r+1)*E/ep-1``) and FSDP-sharded over
``edp``. Tokens reach their experts and come back through :class:`~xtl.module.dispatcher.AllToAllDispatcher`.

Expert gradients: a rank's expert gradient sums the contributions of every token routed to it from its ``ep``
group, and FSDP then reduces over ``edp``; the divide factor is set to the data-parallel size so the result is
the data-parallel mean, as for dense parameters.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from xtl.model import BaseModel
from xtl.module.dispatcher import AllToAllDispatcher
from xtl.strategies.layout import ParallelMeshes


def split_experts(model: BaseModel, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Split every MoE block's routed experts over ``ep_mesh`` and install the all-to-all dispatcher.

    Works on a model built on ``meta`` (no storage is allocated). Returns the expert modules, for FSDP.

    Raises:
        ValueError: The expert count is not divisible by the expert-parallel size.
    """
    ep = ep_mesh.size()
    experts_modules = []
    for index, block in enumerate(model.moe_blocks()):
        if block.num_experts % ep:
            raise ValueError(
                f"MoE block {index}: {block.num_experts} routed experts do not split over expert_parallel_size={ep}; "
                f"use a divisor of {block.num_experts}"
            )
        for param_name, param in list(block.experts.named_parameters(recurse=False)):
            shard = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            block.experts.register_parameter(param_name, nn.Parameter(shard, requires_grad=param.requires_grad))
        block.use_dispatcher(AllToAllDispatcher(block.num_experts, ep_mesh.get_group()))
        experts_modules.append(block.experts)
    return experts_modules


def shard_experts(experts_modules: list[nn.Module], meshes: ParallelMeshes, fsdp_kwargs: dict[str, Any]) -> None:
    """FSDP2 on each expert module over ``edp``, averaging gradients over every rank (as the dense parameters).

    On gloo (no ``PREMUL_SUM``) the reduction is forced to a sum followed by the division, but only when ``edp``
    has more than one rank: torch 2.13 divides twice when a size-1 mesh forces the sum.
    """
    from torch.distributed.fsdp import fully_shard

    gloo = dist.get_backend(meshes.edp.get_group()) == "gloo"
    for experts in experts_modules:
        fully_shard(experts, **{**fsdp_kwargs, "mesh": meshes.edp})
        experts.set_gradient_divide_factor(float(meshes.layout.world_size))
        if gloo and meshes.edp.size() > 1:
            experts.set_force_sum_reduction_for_comms(True)
