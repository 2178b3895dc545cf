"""Activation checkpointing: decoder layers keep few activations in forward and recompute the rest in backward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch.distributed._composable import checkpoint
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from xtl.callbacks._layers import check_every_n_layers, chosen_stacks, select_layers
from xtl.model import BaseModel
from xtl.strategies.parallelize import ModelTransform, TransformStage

CheckpointMode = Literal["full", "selective"]
MODES: tuple[str, ...] = ("full", "selective")


class ActivationCheckpointing(pl.Callback, ModelTransform):
    """Checkpoint blocks (stage ``ACTIVATION``): their activations are recomputed in backward.

    The blocks are the model's decoder layers and, for vision-language models, its vision blocks
    (:meth:`~xtl.model.BaseModel.layer_stacks`; ``parts`` chooses among them).

    Uses the composable ``torch.distributed._composable.checkpoint`` (non-reentrant, hooks on the layer), so
    parameter names stay unchanged (HF weights load by name) and FSDP2 shards the layers afterwards as usual.

    - ``mode: full`` keeps only each chosen layer's inputs; backward runs the layer's forward again.
    - ``mode: selective`` is op-level: matmul and attention outputs (``aten.mm``, ``addmm``, ``bmm``,
      ``_grouped_mm``, ``_scaled_mm``, ``_scaled_dot_product_*``, ...) are kept, the cheap ops between them
      (norms, activations, rotary, residual adds) are recomputed.

    In MoE layers (layers holding a router) the ``topk`` routing decisions are always kept, so recomputation
    reuses the forward's routing even where kernels are not bitwise deterministic: the experts' row counts,
    and thereby every recomputed shape, match the forward (no ``CheckpointError``).

    Gradients equal those without checkpointing bitwise on deterministic kernels (recomputation repeats the same
    ops on the same inputs).

    Args:
        mode: ``full`` or ``selective`` (see above).
        every_n_layers: Checkpoint layers ``i`` with ``i % every_n_layers == 0`` within each part (1: every layer).
        parts: The parts whose blocks are checkpointed (``language``, ``vision``; ``None``: all the model has).

    Attributes:
        checkpointed_layers: Part -> indices of the blocks checkpointed by :meth:`transform_model`.
    """

    transform_stage = TransformStage.ACTIVATION

    def __init__(self, mode: CheckpointMode = "full", every_n_layers: int = 1, parts: list[str] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"activation checkpointing mode must be one of {MODES}; got {mode!r}")
        self.mode = mode
        self.every_n_layers = check_every_n_layers(every_n_layers)
        self.parts = parts
        self.checkpointed_layers: dict[str, list[int]] = {}

    def transform_model(self, model: BaseModel) -> BaseModel:
        """Install checkpointing on the chosen blocks of ``model`` (built on meta; names unchanged)."""
        self.checkpointed_layers = {}
        moe_blocks = {id(block) for block in model.moe_blocks()}
        for part, stack in chosen_stacks(model, self.parts, "ActivationCheckpointing.parts").items():
            self.checkpointed_layers[part] = select_layers(len(stack), self.every_n_layers, part=part)
            for index in self.checkpointed_layers[part]:
                layer = stack[index]
                routed = any(id(module) in moe_blocks for module in layer.modules())
                checkpoint(layer, context_fn=self.context_fn(routed))
        return model

    def memory_settings(self) -> dict[str, Any]:
        """The decoder layers' recompute mode and stride, for ``xtl memory --config``."""
        return {"recompute": self.mode, "recompute_every_n_layers": self.every_n_layers}

    def context_fn(self, routed: bool) -> Callable[[], tuple[Any, Any]] | None:
        """The selective-checkpoint contexts of a block (``routed``: it holds an MoE block; ``None``: plain full
        recomputation)."""
        if self.mode == "selective":
            return functools.partial(create_selective_checkpoint_contexts, save_matmuls_policy)
        if routed:
            return functools.partial(create_selective_checkpoint_contexts, save_routing_policy)
        return None


def save_matmuls_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy: keep matmul, attention and routing outputs, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in _MATMUL_OPS or op in _ROUTING_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def save_routing_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Full-recompute policy for MoE layers: keep only the routing decisions (``topk``), recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in _ROUTING_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _ops(namespace: Any, names: tuple[str, ...]) -> frozenset:
    """The default overloads of the ops of ``namespace`` that this torch build has."""
    return frozenset(getattr(namespace, name).default for name in names if hasattr(namespace, name))


_MATMUL_OPS = _ops(
    torch.ops.aten,
    (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_grouped_mm",
        "_scaled_mm",
        "_scaled_grouped_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    ),
)
_ROUTING_OPS = _ops(torch.ops.aten, ("topk",))

# Selective checkpointing replays ops by count. FSDP2's hooks open profiler ranges a different number of times in
# forward and in recomputation (under the recomputation's replay they are "not found in storage"); the ranges are
# annotations, not tensor work, so the replay passes them through (as upstream PyTorch does from 2.14).
_PROFILER_PACKETS = (torch.ops.profiler._record_function_enter_new, torch.ops.profiler._record_function_exit)
torch_checkpoint.SAC_IGNORED_OPS.update(getattr(p, overload) for p in _PROFILER_PACKETS for overload in p.overloads())
